"""What Prometheus metrics cost a call (:mod:`reactor_dist.metrics`): ``runner.generate(1)``
on one echo runner (world_size 2, ``record_timings=True`` throughout) with the runner
registered on a registry and not, timed in alternating blocks in the same run (the order
flipping every round).  Target: registered costs ≤ 2 µs a call more.  A per-rank time
that the metrics gain later (collective waits) is paid inside the same blocks.
``python -m benchmarks.metrics_cost`` measures the same, and the observer's part alone
in process.
"""

from __future__ import annotations

from collections.abc import Callable

from benchmarks.config import Settings
from benchmarks.families.overhead import INPUT
from benchmarks.implementations.pools import EchoRunner
from benchmarks.report.results import Results, Row, extra_row
from benchmarks.report.stats import alternate_blocks, record_calls, summarize

WORLD_SIZE = 2
TARGET_S = 2e-6
METRIC = "metrics"
ON, OFF = "metrics registered", "metrics not registered"


def measure(settings: Settings, results: Results) -> None:
    from prometheus_client import CollectorRegistry

    from reactor_dist import metrics

    s = settings
    echo = EchoRunner(WORLD_SIZE)
    runner = echo.runner
    runner.record_timings = True
    registry = CollectorRegistry()
    handle: list = []
    try:
        def block(on: bool) -> Callable[[int, list[float]], None]:
            def run(n: int, into: list[float]) -> None:
                if on and not handle:
                    handle.append(metrics.register(runner, registry, name="bench"))
                elif not on and handle:
                    metrics.unregister(handle.pop())
                record_calls(lambda: runner.generate(INPUT), n, into)
            return run

        samples = alternate_blocks({ON: block(True), OFF: block(False)}, calls=s.aio_calls,
                                   warmup=s.aio_warmup, rounds=s.aio_rounds)
    finally:
        if handle:
            metrics.unregister(handle.pop())
        echo.close()
    for key, v in samples.items():
        results.put(METRIC, f"ws{WORLD_SIZE}", key, summarize(v))


def rows(results: Results, settings: Settings) -> list[Row]:
    cfg = f"ws{WORLD_SIZE}"
    on, off = results.get(METRIC, cfg, ON), results.get(METRIC, cfg, OFF)
    return [extra_row(f"Prometheus metrics (echo worker, world_size {WORLD_SIZE})",
                      "generate(1), metrics registered vs not", on, off,
                      "the same runner, not registered (timings on in both)", TARGET_S)]
