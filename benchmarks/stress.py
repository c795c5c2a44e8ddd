"""``python -m benchmarks.stress [N]`` (``make stress N=...``): N runner lifetimes (default
3000), each one ``start()`` with a short ``start_timeout``, one ``generate()`` and
``shutdown()``, spread evenly over world_size 2, 3 and 4 with ``init_process_group`` on
and off; the second half of them beside a CPU hog (one busy-looping process per core,
ended at the end).  A hang is a WorkerTimeout on start or on the call: any hang (or any
other failure) makes the exit status non-zero.

Prints one row per configuration: lifetimes, hangs, other failures, start() p50/p90 and
the PINGs the runner published per start (``Supervisor.pings_sent``; issue 19: before
pacing, every message that arrived published another one, thousands per start).
``--world-sizes``, ``--group`` and ``--hog`` narrow the run (e.g. for a before/after
comparison at one configuration).  Not part of ``make test``.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

from reactor_dist import DistributedRunner, DistributedWorker, WorkerTimeout


class Echo(DistributedWorker):
    """Returns its input."""

    def generate(self, x, /):
        return x


@dataclass
class Tally:
    """One configuration's lifetimes."""

    lifetimes: int = 0
    hangs: int = 0
    failures: int = 0
    starts: list[float] = field(default_factory=list)
    pings: list[int] = field(default_factory=list)
    first_errors: list[str] = field(default_factory=list)

    def add(self, other: Tally) -> None:
        self.lifetimes += other.lifetimes
        self.hangs += other.hangs
        self.failures += other.failures
        self.starts += other.starts
        self.pings += other.pings


def lifetime(world_size: int, group: bool, start_timeout: float, tally: Tally) -> None:
    """One runner's life; counts a hang, a failure or its start time and pings."""
    from benchmarks import stress  # the worker's importable name (never __main__'s)

    tally.lifetimes += 1
    runner = DistributedRunner(stress.Echo, world_size=world_size, device="cpu",
                               init_process_group=group, start_timeout=start_timeout,
                               call_timeout=start_timeout)
    try:
        began = time.monotonic()
        runner.start()
        tally.starts.append(time.monotonic() - began)
        pings = getattr(runner._supervisor, "pings_sent", None)
        if isinstance(pings, int):
            tally.pings.append(pings)
        if runner.generate(world_size) != world_size:
            raise AssertionError("generate() returned a wrong value")
    except WorkerTimeout as exc:
        tally.hangs += 1
        tally.first_errors.append(f"HANG: {str(exc).splitlines()[0]}")
    except Exception as exc:
        tally.failures += 1
        tally.first_errors.append(f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
    finally:
        runner.shutdown()


class CpuHog:
    """One busy-looping process per core, for as long as the ``with`` lasts."""

    def __enter__(self) -> CpuHog:
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                      for _ in range(os.cpu_count() or 1)]
        return self

    def __exit__(self, *exc_info: object) -> None:
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:
            proc.wait()


def quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def row(name: str, t: Tally) -> str:
    pings = (f"{statistics.median(t.pings):16.0f}{quantile(t.pings, 0.9):7.0f}"
             f"{max(t.pings):7d}") if t.pings else f"{'-':>16s}{'-':>7s}{'-':>7s}"
    return (f"{name:26s}{t.lifetimes:6d}{t.hangs:7d}{t.failures:7d}"
            f"{statistics.median(t.starts) if t.starts else float('nan'):10.3f}"
            f"{quantile(t.starts, 0.9):8.3f}{pings}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.stress",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("count", nargs="?", type=int, default=3000, help="runner lifetimes")
    ap.add_argument("--world-sizes", default="2,3,4")
    ap.add_argument("--group", choices=("both", "on", "off"), default="both",
                    help="init_process_group")
    ap.add_argument("--hog", choices=("half", "on", "off"), default="half",
                    help="CPU hog beside the second half, all or none of the lifetimes")
    ap.add_argument("--start-timeout", type=float, default=60.0)
    ap.add_argument("--raw", metavar="PATH", help="also write every start's seconds and "
                    "pings there (JSON), to pool several runs")
    args = ap.parse_args(argv)
    if args.count < 1:
        ap.error("count must be at least 1")
    sizes = [int(s) for s in args.world_sizes.split(",")]
    groups = {"both": [False, True], "on": [True], "off": [False]}[args.group]
    configs = list(itertools.product(sizes, groups))
    hogged = {"half": args.count // 2, "on": 0, "off": args.count}[args.hog]
    phases = [(False, hogged), (True, args.count - hogged)]
    tallies: dict[tuple[int, bool, bool], Tally] = {}
    print(f"{args.count} runner lifetimes over world_size {args.world_sizes}, "
          f"init_process_group {args.group}, CPU hog {args.hog} "
          f"({os.cpu_count()} cores), start_timeout {args.start_timeout:g} s", flush=True)
    began = time.monotonic()
    done = 0
    for hog, count in phases:
        if count <= 0:
            continue
        with CpuHog() if hog else contextlib.nullcontext():
            for i in range(count):
                size, group = configs[i % len(configs)]
                tally = tallies.setdefault((size, group, hog), Tally())
                lifetime(size, group, args.start_timeout, tally)
                done += 1
                if done % 50 == 0:
                    hangs = sum(t.hangs for t in tallies.values())
                    print(f"  {done}/{args.count} lifetimes, {hangs} hangs, "
                          f"{time.monotonic() - began:.0f} s", flush=True)
    wall = time.monotonic() - began
    print(f"\n{'configuration':26s}{'lives':>6s}{'hangs':>7s}{'fails':>7s}"
          f"{'start p50':>10s}{'p90':>8s}{'pings/start p50':>16s}{'p90':>7s}{'max':>7s}")
    total = Tally()
    for (size, group, hog), tally in sorted(tallies.items()):
        name = f"ws={size} group={'on' if group else 'off'} hog={'on' if hog else 'off'}"
        print(row(name, tally))
        total.add(tally)
    print(row("all", total))
    print(f"\n{wall:.0f} s in all, {wall / args.count:.2f} s per lifetime")
    if args.raw:
        with open(args.raw, "w") as f:
            json.dump({"starts": total.starts, "pings": total.pings, "hangs": total.hangs,
                       "failures": total.failures}, f)
    errors = [e for t in tallies.values() for e in t.first_errors]
    for error in errors[:10]:
        print(f"  {error}")
    return 1 if total.hangs or total.failures else 0


if __name__ == "__main__":
    sys.exit(main())
