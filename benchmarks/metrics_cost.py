"""``python -m benchmarks.metrics_cost [--world-size N] [--calls N] [--rounds N]``: what
Prometheus metrics (:func:`reactor_dist.metrics.register`) cost a call.

Two measurements, in the same run:

* in process: the observer's work for one call alone (``RunnerMetrics.settled``: one
  counter and the duration, overhead and per-rank compute histograms), timed over many
  iterations: nanoseconds, free of the machine's noise;
* a real runner (``world_size`` CPU ranks, a worker that returns its input, no process
  group, ``record_timings=True`` throughout): ``runner.generate(1)`` timed in
  alternating blocks with the runner registered on a registry and not, so that drift in
  the machine's load hits both alike.  Target: ≤ 2 µs a call more when registered.

Prints medians and the difference; asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from prometheus_client import CollectorRegistry

from reactor_dist import DistributedRunner, DistributedWorker, metrics
from reactor_dist.caller.calls import Call
from reactor_dist.caller.observers import OK


class Echo(DistributedWorker):
    def generate(self, x, /):
        return x


def observer_ns(runner: DistributedRunner, world_size: int,
                iterations: int = 200_000) -> float:
    """Nanoseconds of the metrics observer's work per call, in process."""
    handle = metrics.register(runner, CollectorRegistry(), name="in-process")
    try:
        call = Call(1, "generate", None, 1.0, 1.001)
        times = (1.0, 1.001, 1.011, 1.012)
        compute = tuple(0.01 + r * 1e-4 for r in range(world_size))
        settled = handle.settled
        clock = time.perf_counter
        began = clock()
        for _ in range(iterations):
            settled(call, OK, times, compute)
        return (clock() - began) / iterations * 1e9
    finally:
        metrics.unregister(handle)


def per_call_us(runner: DistributedRunner, calls: int) -> list[float]:
    times = []
    for _ in range(calls):
        began = time.perf_counter()
        runner.generate(1)
        times.append((time.perf_counter() - began) * 1e6)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.metrics_cost")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--calls", type=int, default=500, help="calls per block")
    parser.add_argument("--rounds", type=int, default=10, help="blocks of each, alternating")
    args = parser.parse_args(argv)
    on: list[float] = []
    off: list[float] = []
    registry = CollectorRegistry()
    with DistributedRunner(Echo, world_size=args.world_size, init_process_group=False,
                           device="cpu") as runner:
        runner.record_timings = True
        print(f"in process: the metrics observer's work for one call: "
              f"{observer_ns(runner, args.world_size):.0f} ns")
        per_call_us(runner, args.calls)  # warm up
        for i in range(args.rounds):
            for registered in ((True, False) if i % 2 == 0 else (False, True)):
                handle = metrics.register(runner, registry, name="bench") if registered \
                    else None
                (on if registered else off).extend(per_call_us(runner, args.calls))
                if handle is not None:
                    metrics.unregister(handle)
    m_on, m_off = statistics.median(on), statistics.median(off)
    print(f"generate(1), world_size={args.world_size}, record_timings=True, {len(on)} calls "
          f"each, alternating blocks of {args.calls}:")
    print(f"  registered      median {m_on:8.1f} us")
    print(f"  not registered  median {m_off:8.1f} us")
    print(f"  difference             {m_on - m_off:+8.1f} us per call (target: <= +2 us)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
