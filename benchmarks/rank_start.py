"""``python -m benchmarks.rank_start [--trials N]``: what a runner's lifetime (start, one
call, shutdown) costs with its ranks forked from a rank template (reactor_dist.placement.template,
the default) and with them spawned (``REACTOR_DIST_RANK_START=spawn``), with and without
a torch group, world_size 2.

Each setting runs in a fresh interpreter of its own, side by side in one run of this
script, so that the comparison is a same-run one: the first lifetime of a process
(which starts its template) is shown apart from the medians of the later ones.  CPU is
the ranks' (this process's reaped children: the ranks and any template it reaped)
plus the runner's own.  A diagnostic for the test loop (issue 29); it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

from reactor_dist import DistributedRunner, DistributedWorker


class Echo(DistributedWorker):
    def generate(self, x, /):
        return x


def cpu() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    ranks = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + ranks.ru_utime + ranks.ru_stime


def lifetimes(group: bool, trials: int) -> list[list[float]]:
    """[start(), shutdown(), CPU] of each lifetime, in this process."""
    rows = []
    for _ in range(trials):
        cpu0, began = cpu(), time.perf_counter()
        runner = DistributedRunner(Echo, world_size=2, device="cpu", init_process_group=group)
        runner.start()
        started = time.perf_counter()
        runner.generate(1)
        called = time.perf_counter()
        runner.shutdown()
        rows.append([started - began, time.perf_counter() - called, cpu() - cpu0])
    return rows


def run(start: str, group: bool, trials: int) -> list[list[float]]:
    env = dict(os.environ, REACTOR_DIST_RANK_START=start)
    out = subprocess.run([sys.executable, "-m", "benchmarks.rank_start", "--in-process",
                          "group" if group else "none", "--trials", str(trials)],
                         env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.rank_start",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--in-process", choices=["group", "none"],
                        help="one setting's lifetimes in this process (as JSON)")
    args = parser.parse_args()
    if args.in_process:
        print(json.dumps(lifetimes(args.in_process == "group", args.trials)))
        return
    print(f"world_size 2, device cpu; {args.trials} lifetimes per process; seconds "
          f"(first lifetime | median of the rest)")
    print(f"{'':22s}{'start()':>20s}{'shutdown()':>20s}{'CPU per lifetime':>22s}")
    began = time.perf_counter()
    for group in (True, False):
        for start in ("spawn", "fork"):
            rows = run(start, group, args.trials)
            cells = []
            for i in range(3):
                rest = statistics.median(r[i] for r in rows[1:]) if len(rows) > 1 else rows[0][i]
                cells.append(f"{rows[0][i]:7.2f} | {rest:5.2f}")
            name = f"{start}, {'torch group' if group else 'no group'}"
            print(f"{name:22s}{cells[0]:>20s}{cells[1]:>20s}{cells[2]:>22s}")
    load = os.getloadavg()[0]
    print(f"({time.perf_counter() - began:.0f} s; 1-minute load average {load:.1f}; "
          f"this process's CPU {sum(resource.getrusage(resource.RUSAGE_SELF)[:2]):.1f} s)")


if __name__ == "__main__":
    main()
