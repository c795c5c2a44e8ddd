"""Family 1, per-call overhead: an empty ``generate()`` against a raw pyzmq fan-out and
gather with as many peers. This is what every step pays on top of the model."""

from __future__ import annotations

from collections.abc import Callable

from benchmarks.config import Settings
from benchmarks.pools import IMPLEMENTATIONS, OURS, Pool
from benchmarks.results import FLOOR, Results, Row

METRIC = "call"
TARGET_WS = 2
TARGET_RATIO = 1.3


def measure(pools: dict[str, Pool], world_size: int, results: Results, s: Settings) -> None:
    """``pools`` holds the implementations and the raw zmq floor (key ``FLOOR``)."""
    fns: dict[str, Callable[[], object]] = {}
    for name, pool in pools.items():
        if pool.generate(None) is not None:
            results.notes.append(f"{name}: an empty step returned something")
            continue
        fns[name] = lambda p=pool: p.generate(None)
    n = {k: s.call_iters if k in (OURS, FLOOR) else s.baseline_call_iters for k in fns}
    results.measure(METRIC, f"ws{world_size}", fns, n, dict.fromkeys(fns, s.call_warmup),
                    s.call_rounds)


def rows(results: Results, s: Settings) -> list[Row]:
    out = []
    for ws in s.world_sizes:
        cfg = f"ws{ws}"
        row = Row(
            section="Per-call overhead",
            case=f"empty generate(), world_size {ws}",
            unit="us",
            ours=results.get(METRIC, cfg, OURS),
            floor=results.get(METRIC, cfg, FLOOR),
            floor_label="raw pyzmq PUB/SUB+PUSH/PULL, ~100-byte header, same peers",
            baselines={i: results.get(METRIC, cfg, i) for i in IMPLEMENTATIONS if i != OURS},
        )
        if ws == TARGET_WS:
            row.target = f"≤ {TARGET_RATIO}× floor"
            ratio = row.over_floor
            row.met = None if ratio is None else ratio <= TARGET_RATIO
        out.append(row)
    return out
