"""Family 1, per-call overhead: an empty ``generate()`` against a raw pyzmq fan-out and
gather with as many peers. This is what every step pays on top of the model."""

from __future__ import annotations

from benchmarks import floors
from benchmarks.config import Settings
from benchmarks.pools import IMPLEMENTATIONS, OURS, Pool
from benchmarks.results import FLOOR, Results, Row
from benchmarks.stats import time_calls

METRIC = "call"
TARGET_WS = 2
TARGET_RATIO = 1.3


def measure_floor(world_size: int, results: Results, s: Settings) -> None:
    results.put(METRIC, f"ws{world_size}", FLOOR,
                floors.zmq_round_trip(world_size, n=s.call_iters, warmup=s.call_warmup))


def measure(pool: Pool, world_size: int, results: Results, s: Settings) -> None:
    if pool.generate(None) is not None:
        raise RuntimeError(f"{pool.name}: an empty step returned something")
    n = s.call_iters if pool.name == OURS else s.baseline_call_iters
    results.put(METRIC, f"ws{world_size}", pool.name,
                time_calls(lambda: pool.generate(None), n=n, warmup=s.call_warmup))


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
            floor_label="raw pyzmq PUB/SUB+PUSH/PULL",
            baselines={i: results.get(METRIC, cfg, i) for i in IMPLEMENTATIONS if i != OURS},
        )
        if ws == TARGET_WS:
            row.target = f"≤ {TARGET_RATIO}× floor"
            ratio = row.over_floor
            row.met = None if ratio is None else ratio <= TARGET_RATIO
        out.append(row)
    return out
