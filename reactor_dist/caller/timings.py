"""Seeing inside a step: per-call timings, rolling statistics, the straggler warning.

Each rank measures, with ``time.perf_counter``, the seconds it spent inside its
worker method (for a generator worker: inside the generator, not sending its
items) and sends that *duration* in its REPLY (``Field.COMPUTE``); clocks of
different processes are never compared.  The runner splits its own wall time of
the call into three parts::

    encode   call start -> the CALL published (lock, input pickling / segment copy)
    wait     -> every rank's REPLY taken (for a stream: its items decoded meanwhile)
    decode   -> rank 0's result decoded and the outcomes judged

so ``wall == encode + wait + decode``; ``overhead = wall - max(compute)`` is what the
library (and the ranks' waits for each other) added to the slowest rank's work.

A rank in a torch.distributed group also sends the part of its compute it spent waiting
inside collectives (``Field.COLLECTIVE_WAIT``, :mod:`reactor_dist.rank.collective_wait`):
``busy = compute - collective_wait``.  A rank slow *before* a collective makes the
others wait in it, so their compute equals its own; their busy time does not.  The
straggler rule and ``slowest_rank`` therefore compare busy times (equal to compute
where no collective wait was measured).

The per-call cost is one tuple of the raw clock readings and a deque append: the
:class:`CallTimings` record is built only when asked for, and statistics and the
straggler check look back over the kept rows lazily (the check every
:data:`CHECK_EVERY` calls).  ``REACTOR_DIST_TIMINGS=0`` in the caller's environment
(or ``runner.record_timings = False``) turns the bookkeeping off.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import time
from collections.abc import Sequence

log = logging.getLogger("reactor_dist")
# One call as recorded: perf_counter at send, at publish, at the last reply, at the end;
# each rank's compute; each rank's collective wait (None: not measured, no group).
Row = tuple[float, float, float, float, tuple[float, ...], tuple[float, ...] | None]

KEPT_CALLS = 10_000     # the rolling window of runner.stats()
STRAGGLER_WINDOW = 20   # calls whose median busy time the straggler rule compares
STRAGGLER_RATIO = 1.25  # a rank busier than this times the others' median ...
STRAGGLER_MARGIN = 0.002  # ... and at least this many seconds slower
CHECK_EVERY = 20        # calls between straggler checks
WARN_EVERY = 60.0       # seconds between two warnings about one rank


def enabled_by_default() -> bool:
    return os.environ.get("REACTOR_DIST_TIMINGS", "1").strip().lower() not in ("0", "off",
                                                                                "false", "no")


class CallTimings:
    """Where the seconds of one call went (``runner.last_timings``)."""

    __slots__ = ("wall", "compute", "encode", "wait", "decode", "collective_wait")

    def __init__(self, wall: float, compute: tuple[float, ...], encode: float, wait: float,
                 decode: float, collective_wait: tuple[float, ...] | None = None) -> None:
        self.wall = wall          # the caller's seconds, send to answer
        self.compute = compute    # seconds each rank spent inside its worker method
        self.encode = encode      # sending: pickling the input, publishing the CALL
        self.wait = wait          # waiting for every rank's REPLY
        self.decode = decode      # decoding rank 0's result, judging the outcomes
        # of each rank's compute, the seconds it waited in torch.distributed collectives
        # (zeros where not measured: ranks without a group)
        self.collective_wait = collective_wait or (0.0,) * len(compute)

    @classmethod
    def of(cls, row: Row) -> CallTimings:
        started, sent, answered, ended, compute, waits = row
        return cls(ended - started, compute, sent - started, answered - sent, ended - answered,
                   waits)

    @property
    def busy(self) -> tuple[float, ...]:
        """Each rank's compute minus its collective wait: its own work."""
        return busy_of(self.compute, self.collective_wait)

    @property
    def slowest_rank(self) -> int:
        """The rank the others waited for: the most busy time."""
        busy = self.busy
        return max(range(len(busy)), key=busy.__getitem__)

    @property
    def overhead(self) -> float:
        """``wall`` minus the slowest rank's compute."""
        return self.wall - max(self.compute)

    def __repr__(self) -> str:
        compute = ", ".join(f"{c * 1e3:.3f}" for c in self.compute)
        waits = ", ".join(f"{c * 1e3:.3f}" for c in self.collective_wait)
        return (f"<CallTimings wall={self.wall * 1e3:.3f} ms compute=({compute}) ms "
                f"collective_wait=({waits}) ms "
                f"slowest_rank={self.slowest_rank} encode={self.encode * 1e3:.3f} ms "
                f"wait={self.wait * 1e3:.3f} ms decode={self.decode * 1e3:.3f} ms>")


def busy_of(compute: Sequence[float], waits: Sequence[float] | None) -> tuple[float, ...]:
    if waits is None:
        return tuple(compute)
    return tuple([max(c - w, 0.0) for c, w in zip(compute, waits, strict=True)])


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of sorted values, by linear interpolation."""
    if not sorted_values:
        return float("nan")
    pos = (len(sorted_values) - 1) * q
    low = int(pos)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (pos - low)


def median(values: Sequence[float]) -> float:
    return percentile(sorted(values), 0.5)


class Summary:
    """count and p50/p90/p99 (seconds) of one series."""

    __slots__ = ("count", "p50", "p90", "p99")

    def __init__(self, values: Sequence[float]) -> None:
        ordered = sorted(values)
        self.count = len(ordered)
        self.p50, self.p90, self.p99 = (percentile(ordered, q) for q in (0.5, 0.9, 0.99))

    def __repr__(self) -> str:
        return (f"<Summary count={self.count} p50={self.p50:.6f} p90={self.p90:.6f} "
                f"p99={self.p99:.6f}>")


class Stats:
    """``runner.stats()``: per-rank compute, busy time and collective wait, and the
    overhead over the kept calls."""

    def __init__(self, rows: Sequence[Row], world_size: int, total: int) -> None:
        calls = [CallTimings.of(row) for row in rows]
        self.calls = total  # calls recorded since start or the last reset
        ranks = range(world_size)
        self.compute = tuple(Summary([c.compute[r] for c in calls]) for r in ranks)
        self.measured_waits = any(row[5] is not None for row in rows)  # a group's ranks
        busy = [c.busy for c in calls]
        self.busy = tuple(Summary([b[r] for b in busy]) for r in ranks)
        self.collective_wait = tuple(Summary([c.collective_wait[r] for c in calls])
                                     for r in ranks)
        self.overhead = Summary([c.overhead for c in calls])
        self.wall = Summary([c.wall for c in calls])
        self.restarts = 0  # the runner's restarts so far (set by runner.stats())
        self.spares_ready = 0  # spares loaded and waiting now (set by runner.stats())
        self.spare_takeovers = 0  # ranks whose place a spare took (set by runner.stats())
        # Sessions (snapshot_every=; set by runner.stats()): complete snapshots, calls run
        # again by restarts, of those how many gave rank 0 another result, and calls sent
        # again for their caller (retry_failed).
        self.snapshots = self.replayed = self.replay_differences = self.retried = 0

    def __str__(self) -> str:
        rows = [("", "count", "p50 ms", "p90 ms", "p99 ms")]
        named = [(f"rank {r} compute", s) for r, s in enumerate(self.compute)]
        if self.measured_waits:  # only ranks in a group measure it
            named += [(f"rank {r} busy", s) for r, s in enumerate(self.busy)]
            named += [(f"rank {r} collective wait", s)
                      for r, s in enumerate(self.collective_wait)]
        named += [("overhead", self.overhead), ("wall", self.wall)]
        for name, s in named:
            rows.append((name, str(s.count), f"{s.p50 * 1e3:.3f}", f"{s.p90 * 1e3:.3f}",
                         f"{s.p99 * 1e3:.3f}"))
        widths = [max(len(row[i]) for row in rows) for i in range(5)]
        lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                           for i, (cell, w) in enumerate(zip(row, widths, strict=True)))
                 for row in rows]
        return "\n".join(line.rstrip() for line in lines)

    def __repr__(self) -> str:
        return f"<Stats calls={self.calls}>\n{self}"


class Recorder:
    """The runner's timings: the latest call, the rolling window, the straggler rule."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.enabled = enabled_by_default()
        self.latest: Row | None = None
        self.calls: collections.deque[Row] = collections.deque(maxlen=KEPT_CALLS)
        self.total = 0
        self.warned: dict[int, float] = {}  # rank -> monotonic time of its last warning

    @property
    def last(self) -> CallTimings | None:
        return None if self.latest is None else CallTimings.of(self.latest)

    def record(self, started: float, sent: float, answered: float, ended: float,
               compute: tuple[float, ...], waits: tuple[float, ...] | None = None) -> None:
        row = self.latest = (started, sent, answered, ended, compute, waits)
        self.calls.append(row)
        self.total += 1
        if self.world_size > 1 and self.total % CHECK_EVERY == 0 \
                and len(self.calls) >= STRAGGLER_WINDOW:
            self.check_stragglers()

    def stats(self, reset: bool = False) -> Stats:
        result = Stats(list(self.calls), self.world_size, self.total)
        if reset:
            self.reset()
        return result

    def reset(self) -> None:
        self.calls.clear()
        self.total = 0

    def check_stragglers(self) -> None:
        """Warn (rate-limited per rank) about a rank whose median busy time (compute
        minus collective wait) over the last STRAGGLER_WINDOW calls stays above the
        others' by the rule's ratio and margin: the rank the others wait for."""
        recent = [busy_of(row[4], row[5])
                  for row in itertools.islice(reversed(self.calls), STRAGGLER_WINDOW)]
        medians = [median([busy[r] for busy in recent]) for r in range(self.world_size)]
        now = time.monotonic()
        for rank, mine in enumerate(medians):
            others = median(medians[:rank] + medians[rank + 1:])
            if mine <= others * STRAGGLER_RATIO or mine - others < STRAGGLER_MARGIN:
                continue
            last = self.warned.get(rank)
            if last is not None and now - last < WARN_EVERY:
                continue
            self.warned[rank] = now
            log.warning(
                "rank %d is a straggler: its median busy time (compute outside collective "
                "waits) over the last %d calls is %.1f ms, the other ranks' %.1f ms "
                "(%.2fx); every call waits for it. Check "
                "its GPU's clocks and thermals (nvidia-smi -q -d CLOCK,TEMPERATURE), other "
                "processes on its GPU or cores, the size of its shard, and its CPU threads "
                "(share_cpu_cores, OMP_NUM_THREADS)", rank, STRAGGLER_WINDOW, mine * 1e3,
                others * 1e3, mine / others if others > 0 else float("inf"))
