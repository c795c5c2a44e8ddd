"""``python -m benchmarks.per_call [--world-size N] [--calls N] [--warmup N] [--rounds N]
[--trials N]``: what one call costs in a user's plain loop, next to the raw floor, in the
same run. The measurement behind ``make bench``'s per-call rows, alone.

Ours is ``DistributedRunner(EchoWorker, world_size=N, init_process_group=False)`` (a
module-level worker that returns its input) timed on ``runner.generate(1)``, one
``time.perf_counter()`` pair around each call, as a user's loop would see it. The floor
is bare pyzmq peers (``benchmarks/implementations/raw_floor.py``): the caller PUBlishes a
100-byte message, each peer echoes it SUB -> PUSH, the caller takes N echoes on PULL.

Both are up together and timed in alternating blocks (``--rounds``, the order flipping
every round), so drift in the machine's load hits both alike; each trial starts both
afresh. Only the public API of reactor_dist is used. Prints medians, spread and
ours ÷ floor per trial and over all trials; asserts nothing.
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.families.overhead import INPUT, plain_loop_vs_floor
from benchmarks.implementations.pools import OURS
from benchmarks.report.results import FLOOR
from benchmarks.report.stats import Stats, summarize


def line(name: str, st: Stats) -> str:
    return (f"{name:8s}{st.median * 1e6:9.0f}{st.p10 * 1e6:8.0f}{st.p90 * 1e6:8.0f}"
            f"{st.p99 * 1e6:8.0f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.per_call",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--calls", type=int, default=2000, help="timed calls of each, per trial")
    ap.add_argument("--warmup", type=int, default=200, help="untimed calls of each first")
    ap.add_argument("--rounds", type=int, default=10,
                    help="alternating blocks (1: all of one, then all of the other)")
    ap.add_argument("--trials", type=int, default=3, help="fresh runner and peers each")
    args = ap.parse_args(argv)
    print(f"runner.generate({INPUT!r}) vs bare pyzmq echo peers, world_size "
          f"{args.world_size}: {args.trials} trials of {args.calls} calls each after "
          f"{args.warmup} warm-up, in {args.rounds} alternating blocks (µs per call)")
    header = f"{'':8s}{'median':>9s}{'p10':>8s}{'p90':>8s}{'p99':>8s}"
    pooled: dict[str, list[float]] = {OURS: [], FLOOR: []}
    for t in range(args.trials):
        trial = plain_loop_vs_floor(args.world_size, calls=args.calls, warmup=args.warmup,
                                    rounds=args.rounds)
        print(f"trial {t + 1}: ours ÷ floor {trial[OURS].median / trial[FLOOR].median:.2f}×")
        print(header)
        for name, label in ((OURS, "ours"), (FLOOR, "floor")):
            print(line(label, trial[name]))
            pooled[name] += trial[name].samples
    if args.trials > 1:
        ours, floor = summarize(pooled[OURS]), summarize(pooled[FLOOR])
        print(f"all trials: ours ÷ floor {ours.median / floor.median:.2f}×")
        print(header)
        print(line("ours", ours))
        print(line("floor", floor))
    return 0


if __name__ == "__main__":
    sys.exit(main())
