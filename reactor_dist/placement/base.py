"""What every placement shares: one handle per rank (:class:`Rank`), where ranks run
(:class:`Placement`), the handles of one generation of ranks (:class:`Ranks`), and the
one death watch (:class:`DeathWatch`).

A placement starts the ranks and hands back one :class:`Rank` per rank; the supervisor
asks every handle the same things (is it alive, how did it end, its output, its stacks,
its death) and never asks which placement it has.  There are two:
:class:`~reactor_dist.placement.local.LocalPlacement`, where each rank is a child
process of the runner (``local.RankProcess``), and
:class:`~reactor_dist.placement.ray_group.RayGroup`, where each rank is a child of a Ray actor
on its node (``ray_group.HostedRank``, which a RankProcess there answers for).

A death is noticed one way only: :class:`DeathWatch`, a thread that sleeps on the
local ranks' pidfds (and on a launcher's pidfd where a ``launch_prefix`` wraps it) and
posts one notice at the first death, which wakes the runner's wait like a reply
would.  Where a pidfd cannot be had it checks those ranks every 20 ms instead.  A rank
that another thread watches (a Ray host's) posts its notice through the same watch.
"""

from __future__ import annotations

import abc
import os
import select
import signal
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import RankFailure, RankInfo
from ..wire.protocol import Bootstrap

if TYPE_CHECKING:
    from ..caller.bus import Bus

POLL_MS = 20  # how often the watch checks ranks it has no pidfd for
TERM_GRACE = 2.0  # seconds from SIGTERM to SIGKILL when the ranks end
REPLACED_TERM_GRACE = 0.2  # the same for the ranks that a restart replaces


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class Stacks(Protocol):
    """A rank's stacks on their way (:meth:`Rank.stacks_later`)."""

    def text(self) -> str:
        """Every thread's stack, or why there are none; waits for them if need be."""
        ...


class Rank(abc.ABC):
    """One rank's handle, wherever its process runs: what the supervisor, the death
    watch and the failure records ask of a rank, answered alike for every placement, so
    that none of them asks where the rank runs.  Its placement starts it (a handle comes
    started) and ends it (:meth:`end_all`)."""

    rank: int
    pid: int  # the rank's process, as its placement started it (on its node)
    launcher_pid: int  # where its code runs: pid, or a descendant under a launch_prefix
    hostname: str  # the machine it runs on

    @abc.abstractmethod
    def poll(self) -> int | None:
        """The exit code (negative: the signal) once the rank died; None while it runs,
        and where it cannot be known (its host is gone)."""

    @abc.abstractmethod
    def alive(self) -> bool:
        """Not known to have died."""

    @abc.abstractmethod
    def stopped(self) -> bool:
        """Alive but stopped (state T, or t under a tracer): it cannot answer until resumed."""

    @abc.abstractmethod
    def signal(self, sig: int, group: bool = True) -> None:
        """``sig`` to the rank's process group (the rank and what it started), or with
        ``group`` false to the process its code runs in alone (``launcher_pid``: a
        restart's GROUP_ABORT_SIGNAL); a rank already gone is left alone (its pid may be
        another process's by now)."""

    @abc.abstractmethod
    def report_lines(self) -> list[str]:
        """The lines of its output a crash report shows (a dead rank's last ones)."""

    @abc.abstractmethod
    def crash_report(self) -> str:
        """How it ended and its last lines, for a WorkerCrashed."""

    @abc.abstractmethod
    def stacks_later(self) -> Stacks:
        """Ask for every thread's stack now; the answer's ``text()`` waits for them.
        Every silent rank is asked before any answer is waited for (Ranks.stacks), so
        that they dump side by side."""

    @abc.abstractmethod
    def watch_with(self, deaths: DeathWatch) -> None:
        """Have ``deaths`` (its generation's watch) notice this rank's death."""

    @abc.abstractmethod
    def runs_in(self, pid: int, deaths: DeathWatch) -> None:
        """Its code runs in process ``pid`` (its PONG says so): another process than the
        one started where a ``launch_prefix`` does not exec the rank."""

    def become(self, rank: int) -> None:
        """A spare's handle is now rank ``rank``'s (reactor_dist.caller.spares): its records and
        output say so."""
        self.rank = rank

    @classmethod
    @abc.abstractmethod
    def end_all(cls, ranks: Sequence[Rank], grace: float, term_grace: float) -> None:
        """End ``ranks`` (handles of this class) for sure, side by side: up to ``grace``
        seconds to leave by themselves (after a SHUTDOWN; a stopped rank gets none),
        then SIGTERM, and SIGKILL after ``term_grace`` seconds."""


def end_together(ranks: Sequence[Rank], grace: float, term_grace: float) -> None:
    """End ``ranks`` side by side, each kind of handle as its class does (Rank.end_all)."""
    kinds: dict[type[Rank], list[Rank]] = {}
    for proc in ranks:
        kinds.setdefault(type(proc), []).append(proc)
    for kind, procs in kinds.items():
        kind.end_all(procs, grace, term_grace)


class DeathWatch:
    """The one death detector: a thread that calls ``on_death(ranks)`` once, at the
    first death, and :meth:`dead`, which names the dead ranks without a system call
    while none has died.  It owns the pidfds it watches.  Once closed it posts nothing:
    the deaths from then on are expected."""

    def __init__(self, on_death: Callable[[list[int]], None]) -> None:
        self._on_death = on_death
        self._noticed = threading.Lock()  # held for good by the one notice
        self._elsewhere: list[Rank] = []  # watched by another thread, which calls notice()
        self._fds: dict[int, int] = {}  # pidfd -> rank
        self._unwatched: list[Rank] = []  # no pidfd: checked every POLL_MS
        self.fired = False  # a rank has died (read by the caller's thread)
        self.closed = False  # close() began: no notice any more
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._run, name="reactor-dist-death-watch",
                                        daemon=True)
        self._started = False

    def watch(self, proc: Rank, pid: int | None = None) -> None:
        """Watch ``proc``'s rank through ``pid`` (default: the rank's own process)."""
        try:
            self._fds[os.pidfd_open(pid or proc.pid)] = proc.rank
        except (AttributeError, OSError):
            if pid is None:
                self._unwatched.append(proc)
        if self._started:
            os.write(self._wake_w, b"+")  # look at the new set
        else:
            self._started = True
            self._thread.start()

    def _run(self) -> None:
        while True:
            fds = dict(self._fds)  # watch() may add to it meanwhile
            waiting = select.poll()
            for fd in (*fds, self._wake_r):
                waiting.register(fd, select.POLLIN)
            fired = [fd for fd, _ in waiting.poll(POLL_MS if self._unwatched else -1)]
            if self._wake_r in fired:
                if b"x" in os.read(self._wake_r, 4096):
                    return
                continue
            dead = {fds[fd] for fd in fired} | \
                {p.rank for p in self._unwatched if not p.alive()}
            if dead:
                self.notice(sorted(dead))
                return

    def watched_elsewhere(self, proc: Rank) -> None:
        """Count ``proc`` among the ranks :meth:`dead` names; the thread that watches it
        (ray_group.RayGroup.watch) calls :meth:`notice`."""
        self._elsewhere.append(proc)

    def notice(self, dead: list[int]) -> None:
        """The first death alone reaches ``on_death``, and none once closed."""
        if not self.closed and self._noticed.acquire(blocking=False):
            self.fired = True
            self._on_death(dead)

    def dead(self) -> list[int]:
        if not self.fired:
            return []
        fired = select.poll()
        for fd in self._fds:
            fired.register(fd, select.POLLIN)
        dead = {self._fds[fd] for fd, _ in fired.poll(0)}
        gone = [*self._unwatched, *self._elsewhere]
        return sorted(dead | {p.rank for p in gone if not p.alive()})

    def close(self) -> None:
        """End the thread and close the pidfds; deaths are expected from here on."""
        self.closed = True
        if self._wake_w < 0:
            return
        os.write(self._wake_w, b"x")
        if self._started:
            self._thread.join(timeout=5.0)
        for fd in (*self._fds, self._wake_r, self._wake_w):
            os.close(fd)
        self._fds = {}
        self._wake_r = self._wake_w = -1


class Ranks:
    """The rank handles of one generation of a runner's ranks (a restart starts the
    next), in rank order, and the death watch over them."""

    def __init__(self, on_death: Callable[[list[int]], None]) -> None:
        self.procs: list[Rank] = []
        self.watch = DeathWatch(on_death)

    def add(self, proc: Rank) -> None:
        """The next rank's handle, a new one or one kept from the generation before,
        watched from now on."""
        self.procs.append(proc)
        proc.watch_with(self.watch)

    def found_launcher(self, rank: int, pid: Any) -> None:
        """Rank ``rank``'s PONG named the process its code runs in (``pid``)."""
        if isinstance(pid, int):
            self.procs[rank].runs_in(pid, self.watch)

    def dead(self) -> list[int]:
        return self.watch.dead()

    def crash_report(self, dead: list[int]) -> str:
        return "\n".join(self.procs[r].crash_report() for r in dead)

    def infos(self, devices: Sequence[str]) -> tuple[RankInfo, ...]:
        """Each rank's record now (``devices``: the supervisor's, once the ranks said)."""
        return tuple(RankInfo(p.rank, p.launcher_pid or None, p.hostname,
                              _device(devices, p.rank), p.alive()) for p in list(self.procs))

    def failures(self, ranks: Sequence[int], devices: Sequence[str], *,
                 seq: int | None = None, method: str | None = None,
                 errors: Mapping[int, BaseException] | None = None,
                 answered: bool = False) -> tuple[RankFailure, ...]:
        """The records of ``ranks`` in a failure of call ``seq`` (None: outside a call),
        each with its exception from ``errors``; ``answered``: they just replied, so
        they run (not stopped: no look at the process state on that path)."""
        records = []
        for rank in ranks:
            proc = self.procs[rank]
            alive = proc.alive()
            code = None if alive else proc.poll()  # None too: a Ray host's that is gone
            died_of = -code if code is not None and code < 0 else None
            records.append(RankFailure(
                rank, proc.launcher_pid or None, proc.hostname, _device(devices, rank),
                alive, exitcode=code if died_of is None else None,
                signal=None if died_of is None else _signal(died_of),
                stopped=alive and not answered and proc.stopped(),
                output=tuple(proc.report_lines()), error=(errors or {}).get(rank),
                call_seq=seq, method=method))
        return tuple(records)

    def stacks(self, silent: list[int]) -> str:
        """Every thread's stack of each silent rank, or why it has none, shown in the
        caller's error alone (not also forwarded); ``silent`` indexes the handles (a Ray
        host's one rank is its index 0)."""
        asked = [self.procs[i].stacks_later() for i in silent]  # they dump meanwhile
        return "\n".join(later.text() for later in asked)

    def end(self, grace: float, term_grace: float = TERM_GRACE) -> None:
        """Wait up to ``grace`` for a graceful exit, then end every rank for sure
        (Rank.end_all); the watch first, so that these deaths are no notices."""
        self.watch.close()
        end_together(self.procs, grace, term_grace)
        self.procs = []

    def end_replaced(self, ranks: list[int]) -> None:
        """restart(): ``ranks`` end now (their handles stay, for their placement to
        start them again); none are left after a failed restart ended them all."""
        end_together([self.procs[r] for r in ranks if r < len(self.procs)], 0.0,
                     REPLACED_TERM_GRACE)


class Placement(abc.ABC):
    """Where a runner's ranks run, and how they start and end there.  The supervisor
    holds one and asks it; what differs between placements (how a rank starts, its
    bootstrap's fields, what else ends with the ranks) is all here."""

    @property
    @abc.abstractmethod
    def shares_memory(self) -> bool:
        """Every rank maps this machine's /dev/shm (else payloads travel in-band)."""

    @abc.abstractmethod
    def bootstrap_fields(self, rank: int) -> dict[str, Any]:
        """The fields of rank ``rank``'s bootstrap (protocol.Bootstrap) that this
        placement decides: where the rank reaches the bus and the group's store, its GPU."""

    @abc.abstractmethod
    def start(self, ranks: Ranks, bootstrap: Callable[[int], Bootstrap], bus: Bus,
              deadline: float) -> None:
        """Start every rank (``bootstrap(rank)`` is its bootstrap, with
        :meth:`bootstrap_fields`) by ``deadline`` (time.monotonic()): their handles go
        into ``ranks``, in rank order.  ``bus``: the runner's, for ranks that reach it
        from another machine."""

    @abc.abstractmethod
    def restart(self, replaced: list[int], old: Ranks, ranks: Ranks,
                bootstrap: Callable[[int], Bootstrap]) -> None:
        """restart(): the ``replaced`` ranks (ended: Ranks.end_replaced) start again,
        in the same places; the others keep their handles from ``old``.  ``ranks`` takes
        every rank's handle, in rank order."""

    def spare_fields(self, place: int) -> dict[str, Any]:
        """The fields of the bootstrap of a spare in ``place`` (its GPU's index among
        the visible ones; with Ray, its bundle's) that this placement decides."""
        return {}

    def device_index(self, place: int) -> int:
        """The index among the visible GPUs of the GPU that ``place`` holds (a rank's or
        a spare's bootstrap ``device_index``): ``place`` itself, unless ``gpus=`` names
        a GPU twice (LocalPlacement)."""
        return place

    def gpu_of(self, place: int) -> int:
        """Which GPU ``place`` holds, to tell places that share one (a spare on a rank's
        GPU, reactor_dist.caller.spares.match): each its own unless ``gpus=`` says otherwise."""
        return place

    def store_address(self) -> str:
        """Where the group's store is across nodes (rank 0's node, as it is now); ""
        where it is a file in the private directory."""
        return ""

    @abc.abstractmethod
    def start_spare(self, slot: int, place: int, bootstrap: Bootstrap, label: str) -> Rank:
        """Start a spare (reactor_dist.caller.spares) in ``place`` (see :meth:`spare_fields`),
        its output's lines prefixed with ``label``; its handle."""

    def end_ranks(self, ranks: Ranks) -> None:
        """A restart failed: every rank ends now; what the placement holds stays until
        :meth:`close`."""
        ranks.end(0.0)

    @abc.abstractmethod
    def close(self, ranks: Ranks, grace: float) -> None:
        """Every rank ends (``grace`` seconds to leave by itself first), and whatever the
        placement holds with it; safe in any state, and twice."""


def _device(devices: Sequence[str], rank: int) -> str | None:
    return devices[rank] if rank < len(devices) else None


def _signal(signum: int) -> int:
    """A signal.Signals (its name and number) where Python knows the number."""
    try:
        return signal.Signals(signum)
    except ValueError:
        return signum
