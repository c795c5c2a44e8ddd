"""Families 1–3 on every implementation: for each world_size, every implementation and
the raw zmq floor are up at once, so each workload alternates between them (see
``stats.interleave``) and each pays its start-up once."""

from __future__ import annotations

import sys
import time
import traceback

from benchmarks import broadcast, floors, frames, overhead
from benchmarks.config import Settings
from benchmarks.pools import IMPLEMENTATIONS, Pool, open_pool
from benchmarks.results import FLOOR, Results


def _log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def _open_all(ws: int, shapes: list[tuple[int, ...]], results: Results) -> dict[str, Pool]:
    pools: dict[str, Pool] = {}
    for impl in IMPLEMENTATIONS:
        try:
            pools[impl] = open_pool(impl, ws, shapes)
        except Exception as exc:
            traceback.print_exc()
            results.notes.append(f"{impl} world_size {ws} did not start: {exc!r}")
    return pools


def measure(s: Settings, results: Results) -> None:
    for ws in s.world_sizes:
        t0 = time.perf_counter()
        with_results = ws == frames.WORLD_SIZE
        shapes = [p.shape for p in s.payloads] if with_results else []
        pools: dict[str, Pool] = {}
        try:
            pools[FLOOR] = floors.ZmqFloor(ws)
            pools.update(_open_all(ws, shapes, results))
            overhead.measure(pools, ws, results, s)
            pools.pop(FLOOR).close()  # only the empty call has a zmq floor
            if with_results:
                frames.measure(pools, results, s)
            if ws in s.sink_world_sizes:
                broadcast.measure_sink(pools, ws, results, s)
            if ws == broadcast.ECHO_WORLD_SIZE:
                broadcast.measure_echo(pools, results, s)
        finally:
            for pool in pools.values():
                pool.close()
        _log(f"world_size {ws}: {time.perf_counter() - t0:.1f} s")
