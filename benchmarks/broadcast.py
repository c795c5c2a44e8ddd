"""Family 3, input broadcast: the same sizes sent to every rank (each returns ``None``),
and sent then echoed back by rank 0 — the full trip of a video-to-video step."""

from __future__ import annotations

import numpy as np

from benchmarks.config import Settings
from benchmarks.frames import TARGET_PAYLOAD
from benchmarks.pools import IMPLEMENTATIONS, OURS, Pool
from benchmarks.results import FLOOR, Results, Row
from benchmarks.stats import time_calls

SINK_WORLD_SIZES = (2, 4)
ECHO_WORLD_SIZE = 2
ECHO_TARGET = 3.0  # × the copy floor
INPUT_FILL = 3


def measure_sink(pool: Pool, world_size: int, results: Results, s: Settings) -> None:
    iters, warmup = ((s.transfer_iters, s.transfer_warmup) if pool.name == OURS
                     else (s.baseline_transfer_iters, s.baseline_transfer_warmup))
    for p, n in zip(s.payloads, iters, strict=True):
        x = np.full(p.shape, INPUT_FILL, np.uint8)
        if pool.generate(x) is not None:
            raise RuntimeError(f"{pool.name}: a broadcast step returned something")
        stats = time_calls(lambda x=x: pool.generate(x), n=n, warmup=warmup)
        results.put("input", f"{p.label} ws{world_size}", pool.name, stats)


def measure_echo(pool: Pool, results: Results, s: Settings) -> None:
    iters, warmup = ((s.transfer_iters, s.transfer_warmup) if pool.name == OURS
                     else (s.baseline_transfer_iters, s.baseline_transfer_warmup))
    for p, n in zip(s.payloads, iters, strict=True):
        x = np.full(p.shape, INPUT_FILL, np.uint8)
        back = pool.generate(("echo", x))
        if not (isinstance(back, np.ndarray) and back.shape == x.shape
                and back.flat[0] == INPUT_FILL and back.flat[-1] == INPUT_FILL):
            raise RuntimeError(f"{pool.name}: echo of {p.label} came back wrong")
        del back
        stats = time_calls(lambda x=x: pool.generate(("echo", x)), n=n,
                           warmup=warmup)
        results.put("echo", p.label, pool.name, stats)


def rows(results: Results, s: Settings) -> list[Row]:
    baselines = [i for i in IMPLEMENTATIONS if i != OURS]
    out = []
    for ws in SINK_WORLD_SIZES:
        if ws not in s.world_sizes:
            continue
        for p in s.payloads:
            cfg = f"{p.label} ws{ws}"
            out.append(Row(
                section="Input broadcast",
                case=f"{p.label} input to world_size {ws}",
                unit="ms",
                ours=results.get("input", cfg, OURS),
                floor=results.get("copy", p.label, FLOOR),
                floor_label="warm np.copyto",
                baselines={i: results.get("input", cfg, i) for i in baselines},
            ))
    for p in s.payloads:
        row = Row(
            section="Input broadcast",
            case=f"{p.label} input + echo, world_size {ECHO_WORLD_SIZE}",
            unit="ms",
            ours=results.get("echo", p.label, OURS),
            floor=results.get("copy", p.label, FLOOR),
            floor_label="warm np.copyto",
            baselines={i: results.get("echo", p.label, i) for i in baselines},
        )
        if p.label == TARGET_PAYLOAD:
            row.target = f"≤ {ECHO_TARGET:g}× floor"
            ratio = row.over_floor
            row.met = None if ratio is None else ratio <= ECHO_TARGET
        out.append(row)
    return out
