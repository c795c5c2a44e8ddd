"""Input broadcast: the same sizes sent to every rank (each returns ``None``),
and sent then echoed back by rank 0 — the full trip of a video-to-video step."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from benchmarks.config import Settings
from benchmarks.families.frames import TARGET_PAYLOAD, iters_for
from benchmarks.implementations.pools import IMPLEMENTATIONS, OURS, Pool, close_all, open_all
from benchmarks.report.results import FLOOR, Results, Row

ECHO_WORLD_SIZE = 2
ECHO_TARGET = 3.0  # × the copy floor
INPUT_FILL = 3


def _echo_ok(back: object, x: np.ndarray) -> bool:
    return (isinstance(back, np.ndarray) and back.shape == x.shape
            and back.flat[0] == INPUT_FILL and back.flat[-1] == INPUT_FILL)


def _measure(pools: dict[str, Pool], metric: str, config: str, i: int, make_input,
             results: Results, s: Settings) -> None:
    fns: dict[str, Callable[[], object]] = {}
    for name, pool in pools.items():
        inp, check = make_input()
        try:
            if not check(pool.generate(inp)):
                raise RuntimeError("wrong answer")
        except Exception as exc:
            results.notes.append(f"{name}: {metric} {config} failed: {exc!r}")
            continue
        fns[name] = lambda pl=pool, inp=inp: pl.generate(inp)
    n = {k: iters_for(k, i, s)[0] for k in fns}
    warm = {k: iters_for(k, i, s)[1] for k in fns}
    results.measure(metric, config, fns, n, warm, s.transfer_rounds)


def measure(settings: Settings, results: Results) -> None:
    """For each world_size, every implementation up at once for both workloads."""
    s = settings
    for ws in sorted(set(s.sink_world_sizes) | {ECHO_WORLD_SIZE}):
        pools = open_all(IMPLEMENTATIONS, ws, [], results.notes)
        try:
            if ws in s.sink_world_sizes:
                measure_sink(pools, ws, results, s)
            if ws == ECHO_WORLD_SIZE:
                measure_echo(pools, results, s)
        finally:
            close_all(pools)


def measure_sink(pools: dict[str, Pool], world_size: int, results: Results,
                 s: Settings) -> None:
    for i, p in enumerate(s.payloads):
        def make(shape=p.shape):
            return np.full(shape, INPUT_FILL, np.uint8), lambda out: out is None
        _measure(pools, "input", f"{p.label} ws{world_size}", i, make, results, s)


def measure_echo(pools: dict[str, Pool], results: Results, s: Settings) -> None:
    for i, p in enumerate(s.payloads):
        def make(shape=p.shape):
            x = np.full(shape, INPUT_FILL, np.uint8)
            return ("echo", x), lambda out, x=x: _echo_ok(out, x)
        _measure(pools, "echo", p.label, i, make, results, s)


def rows(results: Results, settings: Settings) -> list[Row]:
    s = settings
    baselines = [i for i in IMPLEMENTATIONS if i != OURS]
    out = []
    for ws in s.sink_world_sizes:
        for p in s.payloads:
            cfg = f"{p.label} ws{ws}"
            out.append(Row(
                section="Input broadcast",
                case=f"{p.label} input to world_size {ws}",
                unit="ms",
                ours=results.get("input", cfg, OURS),
                floor=results.get("result", p.label, FLOOR),
                floor_label="warm np.copyto of the same bytes",
                baselines={i: results.get("input", cfg, i) for i in baselines},
            ))
    for p in s.payloads:
        row = Row(
            section="Input broadcast",
            case=f"{p.label} input + echo, world_size {ECHO_WORLD_SIZE}",
            unit="ms",
            ours=results.get("echo", p.label, OURS),
            floor=results.get("result", p.label, FLOOR),
            floor_label="warm np.copyto of the same bytes",
            baselines={i: results.get("echo", p.label, i) for i in baselines},
        )
        if p.label == TARGET_PAYLOAD:
            row.target = f"≤ {ECHO_TARGET:g}× floor"
            ratio = row.over_floor
            row.met = None if ratio is None else ratio <= ECHO_TARGET
        out.append(row)
    return out
