"""Families 1–3 on every implementation: one pool per (implementation, world_size) runs
every workload that applies to it, so each pays its start-up once."""

from __future__ import annotations

import sys
import time
import traceback

from benchmarks import broadcast, frames, overhead
from benchmarks.config import Settings
from benchmarks.pools import IMPLEMENTATIONS, open_pool
from benchmarks.results import Results


def _log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def measure(s: Settings, results: Results) -> None:
    shapes = [p.shape for p in s.payloads]
    _log("floor: warm np.copyto")
    frames.measure_floor(results, s)
    for ws in s.world_sizes:
        _log(f"floor: raw pyzmq round trip, world_size {ws}")
        overhead.measure_floor(ws, results, s)
        for impl in IMPLEMENTATIONS:
            t0 = time.perf_counter()
            needs_results = ws == frames.WORLD_SIZE
            try:
                pool = open_pool(impl, ws, shapes if needs_results else [])
            except Exception as exc:
                traceback.print_exc()
                results.notes.append(f"{impl} world_size {ws} did not start: {exc!r}")
                continue
            try:
                overhead.measure(pool, ws, results, s)
                if needs_results:
                    frames.measure(pool, results, s)
                if ws in broadcast.SINK_WORLD_SIZES:
                    broadcast.measure_sink(pool, ws, results, s)
                if ws == broadcast.ECHO_WORLD_SIZE:
                    broadcast.measure_echo(pool, results, s)
            except Exception as exc:
                traceback.print_exc()
                results.notes.append(f"{impl} world_size {ws} failed: {exc!r}")
            finally:
                pool.close()
            _log(f"{impl} world_size {ws}: {time.perf_counter() - t0:.1f} s")
