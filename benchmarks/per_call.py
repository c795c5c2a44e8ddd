"""``python -m benchmarks.per_call [--world-size N] [--calls N] [--warmup N] [--rounds N]``:
what one call costs in a user's plain loop, next to the raw floor, in the same run.

Ours is ``DistributedRunner(EchoWorker, world_size=N, init_process_group=False)`` (a
module-level worker that returns its input) timed on ``runner.generate(1)``, one
``time.perf_counter()`` pair around each call, exactly as a user's loop would see it.
The floor is bare pyzmq peers (``benchmarks/raw_floor.py``): the caller PUBlishes a
100-byte message, each peer echoes it SUB -> PUSH, the caller takes N echoes on PULL.

Both are up together and timed in alternating blocks (``--rounds``), so drift in the
machine's load hits both alike; nothing else runs in this process. Only the public API
of reactor_dist is used. Prints medians, spread and ours ÷ floor; asserts nothing.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Callable

import numpy as np

INPUT = 1  # what the plain loop sends: a small Python object, pickled like any input


def open_ours(world_size: int):  # -> DistributedRunner
    from benchmarks.bench_workers import EchoWorker
    from reactor_dist import DistributedRunner

    runner = DistributedRunner(EchoWorker, world_size=world_size, init_process_group=False,
                               device="cpu", call_timeout=120.0, start_timeout=120.0)
    try:
        runner.start()
    except BaseException:
        runner.shutdown()
        raise
    return runner


def time_blocks(fns: dict[str, Callable[[], object]], *, calls: int, warmup: int,
                rounds: int) -> dict[str, list[float]]:
    """Seconds per call of each function: ``warmup`` untimed calls each, then ``rounds``
    rounds in which each runs a block of ``calls / rounds`` timed calls in turn (the
    order flips every round). The garbage collector stays on, as in a user's loop."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    gc.collect()
    samples: dict[str, list[float]] = {k: [] for k in fns}
    block = max(1, calls // rounds)
    names = list(fns)
    perf = time.perf_counter
    for i in range(rounds):
        for name in names if i % 2 == 0 else names[::-1]:
            fn, acc = fns[name], samples[name]
            for _ in range(block):
                t0 = perf()
                fn()
                t1 = perf()
                acc.append(t1 - t0)
    return samples


def measure(world_size: int, *, calls: int, warmup: int, rounds: int
            ) -> dict[str, list[float]]:
    """Per-call seconds of ``ours`` (``runner.generate(1)``) and ``floor`` (raw echo)."""
    from benchmarks.raw_floor import RawFloor

    floor = RawFloor(world_size)
    try:
        runner = open_ours(world_size)
        try:
            if runner.generate(INPUT) != INPUT:
                raise RuntimeError("the echo worker did not echo")
            return time_blocks({"ours": lambda: runner.generate(INPUT),
                                "floor": floor.generate},
                               calls=calls, warmup=warmup, rounds=rounds)
        finally:
            runner.shutdown()
    finally:
        floor.close()


def summary(samples: dict[str, list[float]]) -> str:
    lines = [f"{'':8s}{'median':>9s}{'p10':>8s}{'p90':>8s}{'p99':>8s}   (µs per call)"]
    med = {}
    for name, s in samples.items():
        p10, p50, p90, p99 = np.percentile(np.asarray(s) * 1e6, [10, 50, 90, 99])
        med[name] = p50
        lines.append(f"{name:8s}{p50:9.0f}{p10:8.0f}{p90:8.0f}{p99:8.0f}")
    if "ours" in med and "floor" in med:
        lines.append(f"ours ÷ floor: {med['ours'] / med['floor']:.2f}×")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.per_call",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--calls", type=int, default=2000, help="timed calls of each")
    ap.add_argument("--warmup", type=int, default=200, help="untimed calls of each first")
    ap.add_argument("--rounds", type=int, default=10,
                    help="alternating blocks (1: all of ours, then all of the floor)")
    args = ap.parse_args(argv)
    samples = measure(args.world_size, calls=args.calls, warmup=args.warmup,
                      rounds=args.rounds)
    print(f"runner.generate({INPUT!r}) vs raw pyzmq echo, world_size {args.world_size}, "
          f"{args.calls} calls each after {args.warmup} warm-up, {args.rounds} rounds")
    print(summary(samples))
    return 0


if __name__ == "__main__":
    sys.exit(main())
