"""``python -m benchmarks.cpu_per_call [--world-size N] [--calls N] [--trials N]``: where a
call's time goes, as CPU per call, next to the raw pyzmq floor.

On a machine with few cores the threads of a call (the caller, every rank, and each
process's ZeroMQ I/O thread) share the cores, so the wall time of a call follows
the CPU it burns.  This prints, per trial, the wall time and the CPU per call of the
caller's main thread and of the ranks' (or bare peers') main threads, for ours and the
floor in turn (``runner.generate(1)`` and the raw echo floor, as in ``make bench``).
The rank processes are found from the outside, as this process's new children once
the runner started: the benchmarks use only the public API.  A diagnostic for
docs/performance.md's "Where the per-call time goes"; it is not part of ``make bench``
and asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from functools import partial

import psutil

from benchmarks.families.overhead import INPUT
from benchmarks.implementations.pools import EchoRunner
from benchmarks.implementations.raw_floor import RawFloor
from reactor_dist.placement.template import Template


def main_thread_cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system) of the main threads of ``pids``."""
    ticks = 0
    for pid in pids:
        with open(f"/proc/{pid}/task/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def new_children(before: set[int], count: int) -> list[int]:
    """Pids of this process's children that were not there ``before``: the processes
    just started (the rank processes of a runner, the peers of a floor)."""
    pids = [p for p in children() if p not in before]
    if len(pids) != count:
        raise RuntimeError(f"expected {count} new child processes, found {len(pids)}")
    return pids


def children() -> set[int]:
    """This process's children but the rank templates the ranks are forked from."""
    return {p.pid for p in psutil.Process().children()} - Template.pids()


def measure(call: Callable[[], object], peers: list[int], calls: int) -> tuple[float, ...]:
    """(wall, caller CPU, peers' CPU) per call, in µs."""
    for _ in range(calls // 10):
        call()
    caller0, peers0 = time.thread_time(), main_thread_cpu_s(peers)
    wall0 = time.perf_counter()
    for _ in range(calls):
        call()
    wall = time.perf_counter() - wall0
    caller, peer = time.thread_time() - caller0, main_thread_cpu_s(peers) - peers0
    return wall / calls * 1e6, caller / calls * 1e6, peer / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cpu_per_call",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args()
    rows: dict[str, list[tuple[float, ...]]] = {"reactor_dist": [], "floor": []}
    for _ in range(args.trials):
        before = children()
        ours = EchoRunner(args.world_size)
        try:
            ranks = new_children(before, args.world_size)
            rows["reactor_dist"].append(measure(partial(ours.generate, INPUT), ranks,
                                                args.calls))
        finally:
            ours.close()
        before = children()
        floor = RawFloor(args.world_size)
        try:
            peers = new_children(before, args.world_size)
            rows["floor"].append(measure(floor.generate, peers, args.calls))
        finally:
            floor.close()
    print(f"generate({INPUT!r}), world_size {args.world_size}, {args.calls} calls x {args.trials} "
          f"trials (medians; µs per call)")
    print(f"{'':14s}{'wall':>8s}{'caller main thread CPU':>26s}{'ranks main threads CPU':>26s}")
    for name, trials in rows.items():
        wall, caller, peers = (statistics.median(t[i] for t in trials) for i in range(3))
        print(f"{name:14s}{wall:8.0f}{caller:26.1f}{peers:26.1f}")


if __name__ == "__main__":
    main()
