"""What the per-call timings cost (``runner.last_timings``, ``stats()``, the straggler
check): ``runner.generate(1)`` on one echo runner (world_size 2) with
``runner.record_timings`` on and off, timed in alternating blocks in the same run (the
order flipping every round). The ranks always time their compute (two
``perf_counter`` calls and one header field), so that part is in both. Target: the
bookkeeping costs ≤ 5 µs a call. ``python -m benchmarks.timing_cost`` measures the
same, and the caller's part alone in process.

And the collective-wait measurement (:mod:`reactor_dist.rank.collective_wait`): a 2-rank
runner with its gloo group whose ``generate`` does one ``all_reduce`` of one float
through the timed wrapper or through the function it wraps (the ring set aside in both),
in pairs of one call each.  Target: ≤ 2 µs a collective, the median pair's difference.
"""

from __future__ import annotations

from collections.abc import Callable

from benchmarks.config import Settings
from benchmarks.families.overhead import INPUT
from benchmarks.implementations.pools import EchoRunner
from benchmarks.report.results import Results, Row, extra_row
from benchmarks.report.stats import alternate_blocks, on_and_off, record_calls, summarize
from benchmarks.timing_cost import AllReduceOnce

WORLD_SIZE = 2
TARGET_S = 5e-6
METRIC = "timings"
ON, OFF = "timings on", "timings off"
WAITS_TARGET_S = 2e-6
TIMED, UNTIMED = "collective timed", "collective untimed"


def measure(settings: Settings, results: Results) -> None:
    s = settings
    echo = EchoRunner(WORLD_SIZE)
    runner = echo.runner
    try:
        def block(on: bool) -> Callable[[int, list[float]], None]:
            def run(n: int, into: list[float]) -> None:
                runner.record_timings = on
                record_calls(lambda: runner.generate(INPUT), n, into)
            return run

        samples = alternate_blocks({ON: block(True), OFF: block(False)}, calls=s.aio_calls,
                                   warmup=s.aio_warmup, rounds=s.aio_rounds)
    finally:
        echo.close()
    for key, v in samples.items():
        results.put(METRIC, f"ws{WORLD_SIZE}", key, summarize(v))
    measure_collective_waits(s, results)


def measure_collective_waits(s: Settings, results: Results) -> None:
    # in pairs of one call: a target of 2 µs on a ~500 µs call is within what blocks'
    # medians move by between runs
    for key, stats in on_and_off(AllReduceOnce, WORLD_SIZE, TIMED, UNTIMED, calls=s.aio_calls,
                                 warmup=s.aio_warmup).items():
        results.put(METRIC, f"ws{WORLD_SIZE}", key, stats)


def rows(results: Results, settings: Settings) -> list[Row]:
    cfg = f"ws{WORLD_SIZE}"
    on, off = results.get(METRIC, cfg, ON), results.get(METRIC, cfg, OFF)
    section = f"Per-call timings (echo worker, world_size {WORLD_SIZE})"
    timed, untimed = results.get(METRIC, cfg, TIMED), results.get(METRIC, cfg, UNTIMED)
    return [extra_row(section, "generate(1) with runner.last_timings and stats()", on, off,
                      "the same runner with record_timings=False", TARGET_S),
            extra_row(section, "generate() with one all_reduce, its collective wait measured",
                      timed, untimed, "the same all_reduce, not timed", WAITS_TARGET_S,
                      paired=True)]
