"""``python -m benchmarks.timing_cost [--world-size N] [--calls N] [--rounds N]``: what the
per-call timings (``runner.last_timings``, ``runner.stats()``, the straggler check) cost.

Two measurements, in the same run:

* in process: the caller's bookkeeping of one call alone (``Recorder.record`` with the
  straggler check every few calls, and reading each rank's ``Field.COMPUTE``), timed
  over many iterations: nanoseconds, free of the machine's noise;
* a real runner (``world_size`` CPU ranks, a worker that returns its input, no process
  group): ``runner.generate(1)`` timed in alternating blocks with
  ``runner.record_timings`` on and off, so that drift in the machine's load hits both
  alike.  The ranks always measure their compute (two ``perf_counter`` calls and one
  header field): that part is in both columns.

Prints medians and the difference; asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from reactor_dist import DistributedRunner, DistributedWorker
from reactor_dist.calls import Call, compute_seconds
from reactor_dist.protocol import Field
from reactor_dist.timings import Recorder


class Echo(DistributedWorker):
    def generate(self, x, /):
        return x


def bookkeeping_ns(world_size: int, iterations: int = 200_000) -> float:
    """Nanoseconds of the caller's timing bookkeeping per call, in process."""
    pending = Call(1, "generate", None, 1.0, 1.001)
    pending.replies = {r: ({Field.COMPUTE: 0.01 + r * 1e-4}, []) for r in range(world_size)}
    recorder = Recorder(world_size)
    clock = time.perf_counter
    began = clock()
    for _ in range(iterations):
        answered = clock()
        recorder.record(pending.started, pending.sent, answered, clock(),
                        compute_seconds(pending, world_size))
    return (clock() - began) / iterations * 1e9


def per_call_us(runner: DistributedRunner, on: bool, calls: int) -> list[float]:
    runner.record_timings = on
    times = []
    for _ in range(calls):
        began = time.perf_counter()
        runner.generate(1)
        times.append((time.perf_counter() - began) * 1e6)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.timing_cost")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--calls", type=int, default=500, help="calls per block")
    parser.add_argument("--rounds", type=int, default=10, help="blocks of each, alternating")
    args = parser.parse_args(argv)
    print(f"in process: the caller's bookkeeping of one call: "
          f"{bookkeeping_ns(args.world_size):.0f} ns")
    on: list[float] = []
    off: list[float] = []
    with DistributedRunner(Echo, world_size=args.world_size, init_process_group=False,
                           device="cpu") as runner:
        per_call_us(runner, True, args.calls)  # warm up
        for i in range(args.rounds):
            order = (True, False) if i % 2 == 0 else (False, True)
            for flag in order:
                (on if flag else off).extend(per_call_us(runner, flag, args.calls))
    m_on, m_off = statistics.median(on), statistics.median(off)
    print(f"generate(1), world_size={args.world_size}, {len(on)} calls each, alternating "
          f"blocks of {args.calls}:")
    print(f"  timings on   median {m_on:8.1f} us")
    print(f"  timings off  median {m_off:8.1f} us")
    print(f"  difference          {m_on - m_off:+8.1f} us per call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
