"""Per-call overhead: what a user's plain loop pays per ``runner.generate(1)``, against
the raw floor, in the same run.

Ours is the plain loop (``pools.EchoRunner``: a module-level worker that returns its
input, ``init_process_group=False``); the floor is bare pyzmq peers that echo a 100-byte
message SUB -> PUSH to the caller's PULL, started like our ranks (``raw_floor.RawFloor``).
Only those two alternate in the rotation, in fresh processes for each trial; the
baselines are timed afterwards in a rotation of their own, so they never sit between
ours and the floor. ``python -m benchmarks.per_call`` runs the same measurement alone.
"""

from __future__ import annotations

from benchmarks.config import Settings
from benchmarks.implementations.pools import (
    IMPLEMENTATIONS,
    OURS,
    EchoRunner,
    close_all,
    open_all,
)
from benchmarks.implementations.raw_floor import RawFloor
from benchmarks.report.results import FLOOR, Results, Row
from benchmarks.report.stats import Stats, interleave, summarize

METRIC = "call"
TRIAL_RATIO = "call ÷ floor, per trial"  # the spread between trials, shown next to the target
INPUT = 1  # what the plain loop sends: a small Python object, pickled like any input
TARGET_WS = 2
TARGET_RATIO = 1.5


def plain_loop_vs_floor(world_size: int, *, calls: int, warmup: int,
                        rounds: int) -> dict[str, Stats]:
    """One trial: a fresh runner and fresh floor peers, ``generate(1)`` and the echo timed
    in alternating blocks (``rounds`` of ``calls / rounds`` each, after ``warmup``)."""
    errors: list[str] = []
    floor = RawFloor(world_size)
    try:
        ours = EchoRunner(world_size)
        try:
            if ours.generate(INPUT) != INPUT:
                raise RuntimeError("the echo worker did not echo")
            fns = {OURS: lambda: ours.generate(INPUT), FLOOR: floor.generate}
            stats = interleave(fns, dict.fromkeys(fns, calls), warmup=dict.fromkeys(fns, warmup),
                               rounds=rounds, failed=lambda k, e: errors.append(f"{k}: {e!r}"))
        finally:
            ours.close()
    finally:
        floor.close()
    if errors:
        raise RuntimeError("; ".join(errors))
    return stats


def measure(settings: Settings, results: Results) -> None:
    s = settings
    for ws in s.world_sizes:
        cfg = f"ws{ws}"
        pooled: dict[str, list[float]] = {OURS: [], FLOOR: []}
        ratios = []
        for _ in range(s.call_trials):
            trial = plain_loop_vs_floor(ws, calls=s.call_iters, warmup=s.call_warmup,
                                        rounds=s.call_rounds)
            for k in pooled:
                pooled[k] += trial[k].samples
            ratios.append(trial[OURS].median / trial[FLOOR].median)
        for k, v in pooled.items():
            results.put(METRIC, cfg, k, summarize(v))
        results.put(TRIAL_RATIO, cfg, OURS, summarize(ratios))
        baselines_per_call(METRIC, ws, s, results)


def baselines_per_call(metric: str, ws: int, s: Settings, results: Results) -> None:
    """The baselines' ``generate(1)`` at ``ws`` ranks, in a rotation of their own (their
    BenchModel returns an int as it came)."""
    pools = open_all(tuple(i for i in IMPLEMENTATIONS if i != OURS), ws, [], results.notes)
    try:
        fns = {k: (lambda p=p: p.generate(INPUT)) for k, p in pools.items()}
        results.measure(metric, f"ws{ws}", fns, dict.fromkeys(fns, s.baseline_call_iters),
                        dict.fromkeys(fns, s.call_warmup), s.call_rounds)
    finally:
        close_all(pools)


def rows(results: Results, settings: Settings) -> list[Row]:
    out = []
    for ws in settings.world_sizes:
        cfg = f"ws{ws}"
        row = Row(
            section="Per-call overhead",
            case=f"generate(1), world_size {ws}",
            unit="us",
            ours=results.get(METRIC, cfg, OURS),
            floor=results.get(METRIC, cfg, FLOOR),
            floor_label="bare pyzmq peers echoing 100 bytes SUB -> PUSH, as many as ranks",
            baselines={i: results.get(METRIC, cfg, i) for i in IMPLEMENTATIONS if i != OURS},
        )
        trials = results.get(TRIAL_RATIO, cfg, OURS)
        spread = "" if trials is None or trials.n < 2 else \
            f" (trials {min(trials.samples):.2f}–{max(trials.samples):.2f}×)"
        if ws == TARGET_WS:
            row.target = f"≤ {TARGET_RATIO:g}× floor{spread}"
            ratio = row.over_floor
            row.met = None if ratio is None else ratio <= TARGET_RATIO
        elif spread:
            row.target = f"(info: {spread[2:-1]})"
        out.append(row)
    return out

