"""Hot spares: processes that have run ``load()`` and wait to take a dead rank's place.

``DistributedRunner(..., spares=N)`` starts N spares with the ranks.  A spare loads
with ``rank`` None and ``is_spare`` true, joins no group and gets no calls.  At a
restart (reactor_dist.caller.restart) each rank that needs a new process takes a ready spare
instead, while there is one: the spare becomes that rank, joins the new group with the
survivors and runs ``rejoin()`` there, as they do, so the restart costs a group's
forming and no ``load()``.  Then a new spare starts in the background, in the place
(GPU, or Ray bundle) the dead rank left, never on the path of a call.  A spare may
share a rank's GPU (``gpus=[0, 1, 0]``); it then takes only that rank's place, since
NCCL allows one rank per GPU (:func:`match`)::

    caller (this module's thread)                   spare (server.RankServer.wait_as_spare)
    spawn, bootstrap (spare, slot, spare_addr)  ->  load(), rank None
    READY (device, load seconds) on its socket  <-  ...then reads every command, idle
    restart(): REJOIN, TAKERS [[slot, rank]]    ->  becomes rank; joins; rejoin()

A spare's messages go to a socket of their own (``spare_addr``), which this module's
thread reads: the calls' socket is read only while a call waits, a spare's news may
come any time.  The thread also replaces a spare that died or was stopped (a stopped
spare's pipe would fill and stop the bus for the ranks), and logs it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import zmq

from ..errors import WorkerCrashed, WorkerTimeout, rebuild_exception
from ..placement.base import Rank, end_together
from ..wire import framing
from ..wire.protocol import ErrorRecord, Field, Kind, Status

if TYPE_CHECKING:
    from .bus import Bus

log = logging.getLogger("reactor_dist")

LOOK_EVERY = 0.1  # seconds between two looks at the spares (deaths, stops, starts)
SPARE_TERM_GRACE = 0.5  # a spare being ended holds nothing worth a long grace


def spare_label(slot: int) -> str:
    """How logs, errors and its output lines name a spare: "spare 3"."""
    return f"spare {slot}"


@dataclass
class Spare:
    """One spare process: its slot (its name on the bus: world_size and up, never
    reused), its place (the GPU index it holds; with Ray, its bundle), and what its
    READY said."""

    slot: int
    place: int
    proc: Rank
    ready: bool = False
    device: str | None = None
    load_seconds: float | None = None

    @property
    def label(self) -> str:
        return spare_label(self.slot)


def match(gone: list[int], places: list[int], ready: list[Spare],
          gpu_of: Callable[[int], int]) -> dict[int, Spare]:
    """Which of the ``ready`` spares takes the place of which ``gone`` rank, the first
    ranks first (``places``: each rank's place now; ``gpu_of``: the GPU a place holds).

    A spare on a GPU of its own may take any rank's place.  A spare that shares a rank's
    GPU (``gpus=[0, 1, 0]``) takes only that rank's: NCCL allows one rank per GPU, so
    it must not become a second rank there, and a rank whose spare is elsewhere starts
    again in its own place.  A rank takes a spare on its own GPU first, leaving the
    spares on GPUs of their own for the others."""
    places, left, takers = list(places), list(ready), {}
    for rank in gone:
        own = gpu_of(places[rank])
        held = {gpu_of(p) for r, p in enumerate(places) if r != rank}
        fits = [s for s in left if gpu_of(s.place) not in held]
        fits.sort(key=lambda s: gpu_of(s.place) != own)  # stable: spares' order otherwise
        if fits:
            takers[rank] = fits[0]
            left.remove(fits[0])
            places[rank] = fits[0].place
    return takers


class Spares:
    """The spares of one runner: started with the ranks, taken by restarts, replaced in
    the background.  ``start_spare(slot, place, label)`` starts one (its placement's): a place is
    a GPU index among the visible ones, with Ray a bundle of the placement group."""

    def __init__(self, count: int, world_size: int, secret: bytes,
                 start_spare: Callable[[int, int, str], Rank]) -> None:
        self.count, self.world_size = count, world_size
        self.channel = framing.Channel(secret)
        self.start_spare = start_spare
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.spares: list[Spare] = []
        self.wanted: list[int] = []  # places to start a spare in, in the background
        self.next_slot = world_size
        self.takeovers = 0  # ranks whose place a spare took
        self.failed: BaseException | None = None  # a spare's load() raised: none is started
        self.closed = False
        self.pull: zmq.Socket | None = None
        self.thread: threading.Thread | None = None

    @property
    def ready(self) -> int:
        """Spares loaded and waiting."""
        with self.lock:
            return sum(s.ready and s.proc.alive() for s in self.spares)

    def open(self, bus: Bus, addr: str) -> None:
        """Bind the spares' socket at ``addr`` (their bootstraps name it); the bus binds
        it over TCP too where ranks or spares run on other nodes (Bus.open_tcp)."""
        if not self.count:
            return
        self.pull = bus.spare_pull = framing.bounded(bus.ctx.socket(zmq.PULL))
        self.pull.bind(addr)

    def start(self, places: list[int]) -> None:
        """start(): the thread, and one spare in each of ``places`` (side by side with
        the ranks' loads)."""
        if not self.count:
            return
        self.thread = threading.Thread(target=self._run, name="reactor-dist-spares",
                                       daemon=True)
        self.thread.start()
        with self.lock:
            for place in places:
                self._start(place)

    def wait_ready(self, deadline: float, timeout: float | None) -> None:
        """start(): until every spare has loaded; raises what a spare's load() raised,
        WorkerCrashed if one died in it, WorkerTimeout at ``deadline``."""
        with self.lock:
            while not self.failed and not all(s.ready for s in self.spares):
                left = deadline - time.monotonic()
                if left <= 0:
                    loading = ", ".join(s.label for s in self.spares if not s.ready)
                    raise WorkerTimeout(f"no answer from {loading} within {timeout:g} s "
                                        f"during start() (its load() runs: raise "
                                        f"start_timeout if loading takes longer)")
                self.changed.wait(min(left, LOOK_EVERY))
            if self.failed is not None:
                raise self.failed

    def take(self, gone: list[int], places: list[int],
             gpu_of: Callable[[int], int]) -> dict[int, Spare]:
        """restart(): the ready spares that take the places of the ``gone`` ranks (see
        :func:`match`), no longer spares (their thread forgets them; the ranks' death
        watch takes them on)."""
        with self.lock:
            ready = [s for s in self.spares if s.ready and s.proc.alive()]
            takers = match(gone, places, ready, gpu_of)
            for spare in takers.values():
                self.spares.remove(spare)
            self.takeovers += len(takers)
            return takers

    def start_later(self, places: list[int]) -> None:
        """After a takeover: a new spare in each place a dead rank left, in the
        background."""
        with self.lock:
            self.wanted += places

    def stop(self) -> None:
        """Shutdown begins: no spare starts from now on, and none that exits (a SHUTDOWN
        reaches them too) is replaced."""
        with self.lock:
            self.closed = True

    def close(self) -> None:
        """Every spare ends (a SHUTDOWN sent to the ranks reached them first, when there
        was one), and the thread with its socket; twice is fine."""
        self.stop()
        with self.lock:
            spares, self.spares = self.spares, []
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=5.0)
        elif self.thread is None and self.pull is not None:  # start() never came
            self.pull.close(linger=0)
        self.pull = None
        end_together([s.proc for s in spares], 0.0, SPARE_TERM_GRACE)

    # -- the thread ---------------------------------------------------------------------
    def _start(self, place: int) -> None:
        """Under the lock: start a spare in ``place``."""
        slot, self.next_slot = self.next_slot, self.next_slot + 1
        self.spares.append(Spare(slot, place, self.start_spare(slot, place, spare_label(slot))))

    def _run(self) -> None:
        pull = self.pull
        assert pull is not None
        try:
            while True:
                with self.lock:
                    if self.closed:
                        return
                if pull.poll(int(LOOK_EVERY * 1000)):
                    with contextlib.suppress(framing.ProtocolError, zmq.Again):
                        self._heard(*self.channel.recv(pull))
                self._look()
        finally:
            pull.close(linger=0)

    def _heard(self, header: dict, body: list) -> None:
        """A spare's READY: loaded, or its load() raised (then it ends, and no spare is
        started again: each would raise the same)."""
        if header.get(Field.KIND) != Kind.READY:
            return
        with self.lock:
            spare = next((s for s in self.spares if s.slot == header.get(Field.RANK)), None)
            if spare is None:
                return
            pid = header.get(Field.PID)
            if isinstance(pid, int) and pid != spare.proc.pid:  # under a launch_prefix
                spare.proc.launcher_pid = pid
            if header.get(Field.STATUS) == Status.OK:
                spare.ready = True
                spare.device = str(header.get(Field.DEVICE))
                seconds = header.get(Field.LOAD_SECONDS)
                spare.load_seconds = seconds if isinstance(seconds, float) else None
                log.info("%s: load() done in %.2f s on %s (pid %d)", spare.label,
                         spare.load_seconds or float("nan"), spare.device, spare.proc.pid)
            else:
                self.failed = rebuild_exception(ErrorRecord.parse(header.get(Field.ERROR)),
                                                body[0] if body else None, spare.label)
                log.error("%s: load() raised %s: %s; no spare is started again",
                          spare.label, type(self.failed).__name__, self.failed)
                self.spares.remove(spare)
                self.wanted.clear()
                end_together([spare.proc], 0.0, SPARE_TERM_GRACE)
            self.changed.notify_all()

    def _look(self) -> None:
        """Replace a spare that died or was stopped; start the spares wanted."""
        with self.lock:
            if self.closed:
                return
            for spare in list(self.spares):
                gone = not spare.proc.alive()
                if not gone and not spare.proc.stopped():
                    continue
                why = ("died: " + spare.proc.crash_report() if gone
                       else "is stopped: it is ended (its pipe would stop the bus)")
                self.spares.remove(spare)
                end_together([spare.proc], 0.0, SPARE_TERM_GRACE)
                self.changed.notify_all()
                if not spare.ready:  # it died in load(): so would the next one
                    self.failed = WorkerCrashed(f"{spare.label} {why}")
                    self.wanted.clear()
                    log.error("%s during its load(); no spare is started again",
                              self.failed)
                    continue
                log.warning("%s (pid %d) %s; a new spare starts in its place", spare.label,
                            spare.proc.pid, why)
                self.wanted.append(spare.place)
            while self.wanted and self.failed is None:
                self._start(self.wanted.pop(0))
