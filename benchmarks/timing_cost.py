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

And the collective-wait measurement (:mod:`reactor_dist.rank.collective_wait`), also in the
same run:

* in process: the caller's part (reading each rank's ``Field.COLLECTIVE_WAIT``, the
  longer row), and a rank's part: one ``all_reduce`` of a 1-element CPU tensor in a
  1-rank gloo group through the timed wrapper and through the function it wraps, in
  alternating blocks, plus the per-call ``begin()``/``take()``;
* a real runner (``world_size`` CPU ranks with their gloo group): ``generate`` doing one
  such ``all_reduce`` per call through the wrapper or around it, in alternating blocks
  (the per-call ``begin()``/``take()`` and the reply field are in both).

Prints medians and the difference; asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

from reactor_dist import DistributedRunner, DistributedWorker
from reactor_dist.caller.calls import Call, rank_seconds
from reactor_dist.caller.timings import Recorder


class Echo(DistributedWorker):
    def generate(self, x, /):
        return x


def bookkeeping_ns(world_size: int, iterations: int = 200_000) -> float:
    """Nanoseconds of the caller's timing bookkeeping per call, in process."""
    pending = Call(1, "generate", None, 1.0, 1.001)
    pending.compute = {r: 0.01 + r * 1e-4 for r in range(world_size)}  # as replies leave it
    recorder = Recorder(world_size)
    clock = time.perf_counter
    began = clock()
    for _ in range(iterations):
        answered = clock()
        recorder.record(pending.started, pending.sent, answered, clock(),
                        rank_seconds(pending, world_size)[0])
    return (clock() - began) / iterations * 1e9


class AllReduceOnce(DistributedWorker):
    """One all_reduce of a 1-element CPU tensor per call: through the timed wrapper
    (``generate(True)``) or through the function it wraps (``generate(False)``).  The
    rank's collective ring is set aside in both: its cost has rows of its own
    (benchmarks/families/collective_ring.py)."""

    def load(self) -> None:
        import torch

        self.tensor = torch.ones(1)

    def generate(self, timed: bool, /) -> None:
        import torch.distributed as dist

        from reactor_dist.rank import collective_wait

        waits = collective_wait._installed  # the rank's own, installed with its group
        assert waits is not None
        ring, waits.ring = waits.ring, None
        try:
            fn = dist.all_reduce if timed else dist.all_reduce.__reactor_dist_untimed__
            fn(self.tensor)
        finally:
            waits.ring = ring


def waits_bookkeeping_ns(world_size: int, iterations: int = 200_000) -> float:
    """Nanoseconds per call of the caller's bookkeeping with the collective waits."""
    pending = Call(1, "generate", None, 1.0, 1.001)
    pending.compute = {r: 0.01 for r in range(world_size)}  # as replies leave them
    pending.waits = {r: r * 1e-4 for r in range(world_size)}
    recorder = Recorder(world_size)
    clock = time.perf_counter
    began = clock()
    for _ in range(iterations):
        answered = clock()
        recorder.record(pending.started, pending.sent, answered, clock(),
                        *rank_seconds(pending, world_size))
    return (clock() - began) / iterations * 1e9


def wrapper_alone_ns(iterations: int = 200_000) -> float:
    """Nanoseconds the timed wrapper adds around a collective that does nothing: its own
    cost, free of the collective's noise."""
    from reactor_dist.rank.collective_wait import CollectiveWaits, timed

    def nothing(tensor: object) -> None:
        return None

    wrapped = timed(nothing, CollectiveWaits())
    clock = time.perf_counter
    cost = []
    for fn in (wrapped, nothing):
        began = clock()
        for _ in range(iterations):
            fn(1)
        cost.append((clock() - began) / iterations * 1e9)
    return cost[0] - cost[1]


def rank_wrapper_ns(rounds: int = 40, calls: int = 1000) -> tuple[float, float, float]:
    """A rank's part, in process (a 1-rank gloo group): median ns of one all_reduce
    timed and untimed (alternating blocks), and of one call's begin() + take()."""
    import torch
    import torch.distributed as dist

    from reactor_dist.rank import collective_wait

    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            waits = collective_wait.install("cpu")
            tensor = torch.ones(1)
            fns = {"timed": dist.all_reduce,
                   "untimed": dist.all_reduce.__reactor_dist_untimed__}
            samples: dict[str, list[float]] = {k: [] for k in fns}
            clock = time.perf_counter
            for i in range(rounds):
                for key in (list(fns) if i % 2 == 0 else list(fns)[::-1]):
                    fn = fns[key]
                    began = clock()
                    for _ in range(calls):
                        fn(tensor)
                    samples[key].append((clock() - began) / calls * 1e9)
            began = clock()
            for _ in range(calls * 10):
                waits.begin()
                waits.take()
            per_call = (clock() - began) / (calls * 10) * 1e9
        finally:
            dist.destroy_process_group()
    return statistics.median(samples["timed"]), statistics.median(samples["untimed"]), \
        per_call


def collective_blocks(world_size: int, calls: int, rounds: int) -> tuple[float, float]:
    """Median us of generate() with one all_reduce, timed and untimed, alternating."""
    timed: list[float] = []
    untimed: list[float] = []
    with DistributedRunner(AllReduceOnce, world_size=world_size, device="cpu") as runner:
        for flag in (True, False):
            per_call_us(runner, True, calls // 5, flag)  # warm up
        for i in range(rounds):
            for flag in ((True, False) if i % 2 == 0 else (False, True)):
                (timed if flag else untimed).extend(per_call_us(runner, True, calls, flag))
    return statistics.median(timed), statistics.median(untimed)


def per_call_us(runner: DistributedRunner, on: bool, calls: int,
                inp: object = 1) -> list[float]:
    runner.record_timings = on
    times = []
    for _ in range(calls):
        began = time.perf_counter()
        runner.generate(inp)
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
    print("collective waits (ranks in a group):")
    print(f"  in process: the caller's bookkeeping of one call with them: "
          f"{waits_bookkeeping_ns(args.world_size):.0f} ns")
    print(f"  in process: the timed wrapper alone (around a no-op): "
          f"{wrapper_alone_ns():.0f} ns per collective")
    timed_ns, untimed_ns, begin_take_ns = rank_wrapper_ns()
    print(f"  in process: one all_reduce (1 float, 1-rank gloo) timed {timed_ns:.0f} ns, "
          f"untimed {untimed_ns:.0f} ns: {timed_ns - untimed_ns:+.0f} ns per collective; "
          f"begin()+take() {begin_take_ns:.0f} ns per call")
    w_on, w_off = collective_blocks(args.world_size, args.calls, args.rounds)
    print(f"  generate() with one all_reduce, world_size={args.world_size}, alternating "
          f"blocks of {args.calls}:")
    print(f"    timed wrapper  median {w_on:8.1f} us")
    print(f"    untimed        median {w_off:8.1f} us")
    print(f"    difference            {w_on - w_off:+8.1f} us per call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
