"""The runner's side of the ranks: start them, report their failures, end them.

:meth:`Supervisor.start` spawns every rank (:mod:`reactor_dist.placement.local`), binds the
bus (:mod:`reactor_dist.caller.bus`), handshakes and waits for every ``load()``;
:meth:`Supervisor.close` ends them and removes every file.  What happens once per
call is :class:`reactor_dist.caller.calls.CallPath`, which uses this bus, these ranks and
ledgers; the order of calls is :mod:`reactor_dist.caller.call_queue`'s.

The exchanges that bring ranks up (:meth:`Supervisor.exchange`: start(), and
restart()'s with replaced and kept ranks, :mod:`reactor_dist.caller.restart`) send their
commands on a fixed beat (PING_EVERY), whatever arrives meanwhile, each until every
rank it is for has answered it or acknowledged it: a PUB/SUB subscriber that has just
connected may miss a command (the slow joiner), and a command that meets a full pipe
is simply tried again at the next beat, so none is ever lost.  Those are the commands
whose delivery is ``Delivery.BEAT`` in ``protocol.COMMANDS``: the exchange sends
no other kind.  A
death of the current generation of ranks ends the exchange with WorkerCrashed; a
notice of a replaced rank is stale.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pickle
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from struct import error as struct_error
from typing import Any, NamedTuple

import zmq

from .. import timeouts
from ..errors import (
    MainGuardMissing,
    RankInfo,
    WorkerCrashed,
    WorkerTimeout,
    rebuild_exception,
    timeout_error,
)
from ..placement.base import Placement, Rank, Ranks
from ..placement.template import Template
from ..shm import collective_ring, segments
from ..shm.ledger import Ledger, Mapped
from ..wire import log_records, transfer
from ..wire.progress import Display
from ..wire.protocol import (
    COMMANDS,
    PINNED_LIMIT,
    RECORDER_SIGNAL,
    SECRET_SIZE,
    SPARES_SOCKET,
    Bootstrap,
    Delivery,
    ErrorRecord,
    Field,
    Kind,
    Status,
    WorkerRef,
)
from . import open_files
from .bus import Bus, CommandBlocked, private_dir, reclaim_dead_ipc_dirs
from .fault_log import one_line
from .releaser import Releaser
from .spares import Spares


def raise_first_error(answers: Replies) -> None:
    """A rank's load() (or rejoin()) raised: its exception, as start() reports it."""
    for rank, (header, body) in sorted(answers.items()):
        if header.get(Field.STATUS) == Status.RAISED:
            exc = rebuild_exception(ErrorRecord.parse(header.get(Field.ERROR)),
                                    body[0] if body else None, rank)
            if isinstance(exc, MainGuardMissing):
                raise exc from None  # its own message says all; the rank's stack is noise
            raise exc

Replies = dict[int, tuple[dict, list]]

log = logging.getLogger("reactor_dist")

PING_EVERY = 0.02  # seconds between two sends of a command not yet answered
LOOK_EVERY = 0.1  # seconds: the longest receive, so that a shutdown is seen
RECORDER_WAIT = 0.5  # seconds a timeout's ranks get to write their flight recorders


class Ask(NamedTuple):
    """One command of an exchange: what is published, which kind each of ``ranks``
    answers, and which other kinds say that the command arrived (``acks``)."""

    command: dict[str, Any]
    answer: str
    ranks: frozenset[int]
    acks: frozenset[str] = frozenset()



class Supervisor:
    """Processes, bus and segments of one runner; raises the ranks' failures
    (WorkerCrashed, WorkerTimeout) and judges nothing else."""

    def __init__(self, *, worker: WorkerRef, world_size: int, load_kwargs: dict[str, Any],
                 init_process_group: bool, device: str, placement: Placement,
                 shm_dir: str, keep_free: int, start_timeout: float | None,
                 shutdown_grace: float, call_timeout: float | None = 30.0,
                 spares: int = 0, pinned_limit: int = PINNED_LIMIT,
                 record_collectives: bool = True) -> None:
        self.world_size = world_size
        self.placement = placement  # where the ranks run (ray_group.placement_for)
        self.secret = os.urandom(SECRET_SIZE)
        self.shm_dir = shm_dir
        self.shm_prefix = segments.new_runner_prefix()
        self.shutdown_grace = shutdown_grace
        self.owner_pid = os.getpid()  # a forked child must never tear down our ranks
        self.epoch = 0  # the generation of ranks: +1 per restart (restart.py)
        self.closing = False  # shutdown() began: a restart in progress gives up
        self.drop_through = 0  # shutdown() with calls in flight: the ranks skip up to it
        self.devices: list[str] = []  # each rank's device, once started
        # Ranks whose CUDA context broke (Field.BROKEN): alive, but the next restart
        # replaces them (restart.restart) as it does the dead.
        self.lost: set[int] = set()
        self.last_ranks: tuple[RankInfo, ...] = ()  # the ranks' records when they ended
        self.load_seconds: dict[int, float] = {}  # each rank's last load() (READY)
        self.inputs = Ledger(shm_dir, self.shm_prefix, "in", keep_free=keep_free)
        self.results = Mapped(lambda name: segments.Segment.open(shm_dir, name), self._ours)
        self.rings: list[segments.Segment] = []  # each rank's collective ring (collective_ring)
        self.bus: Bus | None = None
        self.releaser: Releaser | None = None
        self.ranks: Ranks | None = None
        self.ipc_dir: str | None = None
        self._owner_lock = -1  # held from start() to close(): see segments.hold_owner_lock
        self._holds_templates = False  # from start() to close(): Template.hold, let_go
        self._dir_lock = -1  # the lock in the private directory: see bus.private_dir
        self.display: Display | None = None  # start()'s progress display
        self._worker, self._load_kwargs = worker, pickle.dumps(load_kwargs, protocol=5)
        self.forms_group = init_process_group  # the runner forms its own torch group
        self.record_collectives = record_collectives  # the ranks get collective rings
        self._device = device
        self._start_timeout, self._keep_free = start_timeout, keep_free
        self._pinned_limit = pinned_limit
        self._group_timeout = timeouts.for_group(call_timeout)
        self.pings = 0  # ping() exchanges so far: each PING's SEQ, echoed in its PONGs
        self.pings_sent = self.inits_sent = 0  # start-up's commands published (stress.py)
        # Each rank's place: its GPU, as an index among the visible ones (with Ray, its
        # bundle); its rank's, until a spare (which holds one after the ranks') takes
        # its place and keeps its own.
        self.place_of = list(range(world_size))
        self.spares = Spares(spares, world_size, self.secret, self._start_spare)

    @property
    def inline_limit(self) -> int:
        """The size from which a buffer goes through shared memory: never, where a rank
        cannot map this machine's (transfer.IN_BAND)."""
        return transfer.INLINE_LIMIT if self.placement.shares_memory else transfer.IN_BAND

    def _ours(self, name: str) -> bool:
        return "/" not in name and name.startswith(self.shm_prefix + ".")

    # -- start ---------------------------------------------------------------------------
    def start(self, timeout: float | None) -> None:
        """Spawn every rank, handshake, form the group, load(); raises what load() raised
        (``timeout`` None: no limit)."""
        deadline = timeouts.deadline_of(timeout)
        open_files.check_room(self.world_size)  # libzmq aborts the process when it runs out
        if not self._holds_templates:  # they stay while we are started (template.py)
            Template.hold()
            self._holds_templates = True
        self._owner_lock = segments.hold_owner_lock(self.shm_dir, self.shm_prefix)
        segments.reclaim_dead_owners(self.shm_dir)
        self.make_rings()
        reclaim_dead_ipc_dirs()
        self.ipc_dir, self._dir_lock = private_dir()
        self.bus = Bus(self.secret, self.ipc_dir, self.world_size)
        self.spares.open(self.bus, f"ipc://{self.ipc_dir}/{SPARES_SOCKET}")
        self.ranks = self.new_ranks()
        self.display = Display(self.world_size)
        try:
            self.start_ranks(deadline, timeout)
        finally:
            self.display.close()
            self.display = None  # a restart's ranks report in the log alone

    def new_ranks(self) -> Ranks:
        """The processes of this generation of ranks (``epoch``), watched: a death
        notice names the generation, so that a replaced rank's is known as stale."""
        bus, epoch = self.bus, self.epoch
        assert bus is not None
        return Ranks(lambda dead: bus.tell_death(dead, epoch))

    def start_ranks(self, deadline: float, timeout: float | None) -> None:
        assert self.ranks is not None and self.bus is not None
        self.placement.start(self.ranks, self.bootstrap, self.bus, deadline)
        self.spares.start(list(range(self.world_size, self.world_size + self.spares.count)))
        log.info("started %d rank%s (pids %s)", self.world_size, "s" if self.world_size > 1
                 else "", ", ".join(str(p.pid) for p in self.ranks.procs))
        everyone = frozenset(range(self.world_size))
        pongs = self.ping(everyone, deadline, timeout, "start()")
        store_port = pongs[0][0].get(Field.PORT) or 0
        # A rank's first PROGRESS after INIT (its phase "forming the torch group" or "loading")
        # says it got INIT: re-sending stops then, not after load().
        init = {Field.KIND: Kind.INIT, Field.SEQ: 0, Field.PORT: store_port}
        ready = self.exchange([Ask(init, Kind.READY, everyone, frozenset({Kind.PROGRESS}))],
                         deadline - time.monotonic(), timeout, "start()", first_error=True)
        if len(ready) == self.world_size:  # else a load() raised: no rank's is known
            self.devices = [str(ready[r][0].get(Field.DEVICE)) for r in sorted(ready)]
        self.log_ready(ready)
        raise_first_error(ready)
        self.spares.wait_ready(deadline, timeout)

    def exchange(self, asks: list[Ask], timeout: float,
                 stated_timeout: float | None, what: str, first_error: bool = False,
                 other: Callable[[dict[str, Any]], None] = lambda header: None,
                 partial: bool = False) -> Replies:
        """Until every rank of every ask answered (each rank is in one ask): the answers.
        WorkerTimeout after ``timeout`` seconds (``stated_timeout`` is the one named;
        ``partial``: the answers so far instead), WorkerCrashed at a death (``partial``: the
        dead rank is no longer waited for).  ``first_error``:
        a RAISED answer ends the wait at once (a failed load() makes the rest pointless).
        ``other`` sees every other message.  An ask with an empty command only waits."""
        bus = self.bus
        assert bus is not None and self.ranks is not None
        for ask in asks:
            if ask.command and COMMANDS[ask.command[Field.KIND]].delivery is not Delivery.BEAT:
                raise ValueError(f"a {ask.command[Field.KIND]} command is not sent on a beat")
        asked = {rank: ask for ask in asks for rank in ask.ranks}
        replies: Replies = {}
        heard: set[int] = set()  # ranks that have their command
        deadline = time.monotonic() + timeout
        beat = time.monotonic()  # when the commands are next due
        while len(replies) < len(asked):
            if self.closing:
                raise RuntimeError(f"the runner was shut down during {what}")
            now = time.monotonic()
            sending = len(heard) < len(asked)
            if partial and now >= beat:  # a rank known dead is not waited for
                for gone in [r for r in asked if r not in replies and
                             not self.ranks.procs[r].alive()]:
                    asked.pop(gone)
                if len(replies) == len(asked):
                    break
            if sending and now >= beat:
                for ask in asks:
                    if ask.command and not ask.ranks <= heard:
                        self.publish_start_command(dict(ask.command))
                beat += PING_EVERY
                if beat <= now:  # fell behind (a slow receive): no burst to catch up
                    beat = now + PING_EVERY
            left = deadline - now
            if left <= 0:
                if partial:
                    return replies
                silent = sorted(r for r in asked if r not in replies)
                raise self.timed_out(silent, stated_timeout, what, replies)
            wait = min(left, beat - now) if sending else min(left, LOOK_EVERY)
            message = bus.receive(timeouts.wait_ms(max(wait, 0.0)))
            if message is None:
                continue
            header = message[0]
            kind, rank = header[Field.KIND], header[Field.RANK]
            ask = asked.get(rank)
            if kind == Kind.DEATH:
                dead = self.dead_of(header)
                if dead is None:
                    continue  # a replaced rank's
                if not partial:
                    raise self.crashed(dead, what)
                # partial (restart()'s grace PING): the dead simply do not answer, and a
                # notice of a death before the restart (not yet read) is no failure of it
                for gone in dead:
                    if gone not in replies:
                        asked.pop(gone, None)
                continue
            if kind == Kind.PONG and ask is not None and \
                    header.get(Field.SEQ) != ask.command.get(Field.SEQ):
                continue  # the answer to an earlier ping(), maybe of an ended process
            if ask is not None and (kind == ask.answer or kind in ask.acks):
                heard.add(rank)
            if ask is not None and kind == ask.answer:
                if rank not in replies:
                    replies[rank] = message
                    if first_error and header.get(Field.STATUS) == Status.RAISED:
                        return {rank: message}
            elif kind == Kind.PROGRESS:
                if self.display is not None:
                    self.display.update(header)
            else:
                other(header)
        return replies

    def ping(self, ranks: frozenset[int], deadline: float, timeout: float | None,
             what: str, other: Callable[[dict[str, Any]], None] = lambda header: None,
             partial: bool = False) -> Replies:
        """PING until each of ``ranks`` answered (PUB/SUB's slow joiner): their PONGs
        (``partial``: those that came by the deadline)."""
        assert self.ranks is not None
        self.pings += 1  # a PONG to an earlier PING (a process since ended) is not one
        pongs = self.exchange([Ask({Field.KIND: Kind.PING, Field.SEQ: self.pings}, Kind.PONG,
                                   ranks)],
                         deadline - time.monotonic(), timeout, what, other=other,
                         partial=partial)
        if not partial:
            for rank, (header, _) in pongs.items():
                self.ranks.found_launcher(rank, header.get(Field.PID))
        return pongs

    def shared_memory_bytes(self) -> int:
        """The input pool's segments and the result segments mapped here, in bytes."""
        return sum(seg.size for seg in list(self.inputs.segments.values())) + \
            self.results.mapped_bytes()

    def start_releaser(self, pass_on: Callable[[], None], last_call: Callable[[], float]) -> None:
        """Rank 0's segments go back between calls (releaser.py), once calls can go."""
        self.releaser = Releaser(self.results.has_released, pass_on, last_call,
                                 self.results.unmap_unused)
        self.results.notify = self.releaser.notify

    def log_ready(self, ready: Replies) -> None:
        """One record for the group, one per rank's load() (each rank's own seconds)."""
        if len(ready) < self.world_size:
            return  # a load() raised: its exception is what start() reports
        formed = [ready[r][0].get(Field.GROUP_SECONDS) for r in sorted(ready)]
        if all(isinstance(s, float) for s in formed):
            log.info("torch group formed (%d ranks) in %.2f s",
                     self.world_size, max(formed))
        for rank in sorted(ready):
            header = ready[rank][0]
            seconds = header.get(Field.LOAD_SECONDS)
            if isinstance(seconds, float):
                self.load_seconds[rank] = seconds
            log.info("rank %d: load() done in %.2f s on %s", rank,
                     seconds if isinstance(seconds, float) else float("nan"),
                     header.get(Field.DEVICE), extra={"rank": rank, "load_seconds": seconds})

    def bootstrap(self, rank: int) -> Bootstrap:
        """Rank ``rank``'s bootstrap, with the fields its placement decides."""
        return Bootstrap(**{**self._own_fields(rank), **self.placement.bootstrap_fields(rank)})

    def _own_fields(self, rank: int) -> dict[str, Any]:
        """The bootstrap's fields that the runner decides (a local rank's)."""
        assert self.bus is not None
        return dict(
            rank=rank, world_size=self.world_size, secret=self.secret,
            cmd_addr=self.bus.cmd_addr, reply_addr=self.bus.reply_addr,
            runner_pid=os.getpid(), shm_dir=self.shm_dir, shm_prefix=self.shm_prefix,
            worker=self._worker, load_kwargs=self._load_kwargs,
            init_process_group=self.forms_group, device=self._device,
            start_timeout=timeouts.for_library(self._start_timeout), keep_free=self._keep_free,
            pinned_limit=self._pinned_limit,
            group_timeout=self._group_timeout,
            sys_path=list(sys.path), device_index=self.placement.device_index(self.place_of[rank]),
            log_levels=log_records.levels())

    def _start_spare(self, slot: int, place: int, label: str) -> Rank:
        """A spare in slot ``slot`` (its name on the bus) in ``place``: the ``place``-th
        GPU, or with Ray the ``place``-th bundle."""
        assert self.ipc_dir is not None
        fields = {**self._own_fields(0), "rank": slot,
                  "device_index": self.placement.device_index(place), "spare": True,
                  "spare_addr": f"ipc://{self.ipc_dir}/{SPARES_SOCKET}",
                  **self.placement.spare_fields(place)}
        return self.placement.start_spare(slot, place, Bootstrap(**fields), label)

    def publish_start_command(self, header: dict[str, Any]) -> None:
        """One try at PING, INIT or REJOIN (PING and INIT counted when sent); a full pipe
        waits for the next beat."""
        assert self.bus is not None
        if self.bus.publish(header):
            if header[Field.KIND] == Kind.PING:
                self.pings_sent += 1
            elif header[Field.KIND] == Kind.INIT:
                self.inits_sent += 1

    def take_output(self) -> None:
        """Forward what the ranks wrote so far (their log records, their lines) now, in
        this thread: a rank writes a record to its pipe before it sends the reply that
        follows it, so a call's records reach the caller's logging before its result
        (the pipe's reader thread alone could be later)."""
        ranks = self.ranks
        if ranks is not None:
            for proc in ranks.procs:
                output = getattr(proc, "output", None)  # Ray's ranks: Ray forwards theirs
                if output is not None:
                    output.drain()

    # -- failures ------------------------------------------------------------------------
    def make_rings(self) -> None:
        """Each rank's collective ring, before the ranks start: the caller makes and maps
        them, so that it reads them after a rank died (collective_ring)."""
        if self.rings or self.world_size < 2 or not self.forms_group or \
                not self.record_collectives:
            return
        for rank in range(self.world_size):
            segment = segments.Segment.create(self.shm_dir,
                                         collective_ring.ring_name(self.shm_prefix, rank),
                                         collective_ring.SIZE, "a collective ring")
            collective_ring.fresh(segment.mm)
            self.rings.append(segment)

    def collectives(self, seq: int | None, dead: Sequence[int] = (),
                    raised: dict[int, str] | None = None) -> collective_ring.Report | None:
        """What every rank's ring says of call ``seq`` (None: the latest recorded), read
        here with no help from the ranks; None when none recorded a collective.
        ``raised``: the ranks that raised in it, by their exception's type."""
        if not self.rings:
            return None
        try:
            rings = {r: collective_ring.read(segment.mm) for r, segment in enumerate(self.rings)}
        except (ValueError, struct_error):  # closed meanwhile, or a torn header
            return None
        return collective_ring.report(rings, seq, dead, raised=raised)

    def begun(self, rank: int) -> int | None:
        """The seq of the call rank ``rank`` began last, read from its ring (None: no
        ring here, as at world_size 1 or across nodes, or none begun yet)."""
        try:
            return collective_ring.begun(self.rings[rank].mm) or None
        except (IndexError, ValueError):  # no ring, or closed meanwhile
            return None

    def ask_recorders(self) -> tuple[dict[int, int], float]:
        """RECORDER_SIGNAL to every live rank that writes in its ring (one on another
        node has none): each writes its torch group's flight recorder there
        (rank.flight_recorder).  The answers each had written, and until when
        :meth:`recorders` waits for the new ones."""
        assert self.ranks is not None
        dead = set(self.ranks.dead())
        asked = {}
        for rank, segment in enumerate(self.rings):
            if rank in dead or rank >= len(self.ranks.procs):
                continue
            try:
                if not collective_ring.begun(segment.mm):
                    continue  # it never wrote there: no thread of it would answer
                asked[rank] = collective_ring.recorded(segment.mm)[0]
            except (ValueError, struct_error):  # closed meanwhile
                continue
            self.ranks.procs[rank].signal(RECORDER_SIGNAL, group=False)
        return asked, time.monotonic() + RECORDER_WAIT

    def recorders(self, asked: dict[int, int], deadline: float) -> str:
        """The answers to :meth:`ask_recorders`, a line per rank ("" when none was asked
        or every one's recorder is empty), waited for until ``deadline``."""
        answers: dict[int, list[dict]] = {}
        while asked:
            for rank, before in asked.items():
                if rank not in answers:
                    with contextlib.suppress(ValueError, struct_error):
                        count, entries = collective_ring.recorded(self.rings[rank].mm)
                        if count > before:
                            answers[rank] = entries
            if len(answers) == len(asked) or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        if answers and not any(answers.values()) and len(answers) == len(asked):
            return ""  # no rank's torch keeps one (TORCH_FR_BUFFER_SIZE=0, or an old torch)
        return "".join(
            f"\n  rank {rank}: " + (collective_ring.describe_recorded(answers[rank])
                                    if rank in answers else
                                    f"no answer within {RECORDER_WAIT:g} s")
            for rank in sorted(asked))

    def with_collectives(self, error: Any, report: collective_ring.Report | None) -> None:
        """Each failure record of ``error`` gets its rank's collective line."""
        if report is not None:
            error.failures = tuple(dataclasses.replace(f, collective=report.lines.get(f.rank))
                                   for f in error.failures)

    def begin_closing(self) -> None:
        """shutdown() began: an exchange in progress (a restart's) gives up at its next
        look."""
        self.closing = True

    def dead_of(self, notice: dict[str, Any]) -> list[int] | None:
        """A death notice (Kind.DEATH), read the one way every wait reads it: the ranks
        dead now (the notice's own rank where the watch names none yet); None for a
        notice of a generation a restart replaced (stale: dropped)."""
        if notice.get(Field.EPOCH, 0) != self.epoch:
            return None
        return self.dead() or [notice[Field.RANK]]

    def dead(self) -> list[int]:
        """The ranks that have died (no system call while none has)."""
        return self.ranks.dead() if self.ranks is not None else []

    def rank_infos(self) -> tuple[RankInfo, ...]:
        """Each rank's record (runner.ranks): () before start(), the last known (not
        alive) once the ranks ended."""
        ranks = self.ranks
        if ranks is None or not ranks.procs:
            return self.last_ranks
        return ranks.infos(self.devices)

    def _ending(self) -> None:
        """The ranks end now: keep their records, not alive, for runner.ranks."""
        if self.ranks is not None and self.ranks.procs:
            self.last_ranks = tuple(dataclasses.replace(info, alive=False)
                                    for info in self.ranks.infos(self.devices))

    def crashed(self, dead: list[int], what: str, seq: int | None = None,
                method: str | None = None, logged: bool = True) -> WorkerCrashed:
        """The WorkerCrashed of the ``dead`` ranks, their records in ``failures``;
        ``seq``, ``method``: the call they died in (None: outside a call).  ``logged``:
        its one-line ERROR record here (the call queue logs the faults of calls itself,
        at the level their outcome deserves)."""
        assert self.ranks is not None
        report = self.collectives(seq, dead)
        first = f"{report.headline}\n" if report is not None and report.headline else ""
        lines = f"\nthe ranks' collectives:{report.text()}" if report is not None else ""
        error = WorkerCrashed(f"{first}rank {', '.join(map(str, dead))} died during {what}: "
                              f"{self.ranks.crash_report(dead)}{lines}")
        error.failures = self.ranks.failures(dead, self.devices, seq=seq, method=method)
        self.with_collectives(error, report)
        if logged:
            log.error("%s", one_line(error))
        return error

    def timed_out(self, silent: list[int], timeout: float | None, what: str,
                  replies: Replies, seq: int | None = None,
                  method: str | None = None) -> WorkerTimeout:
        """The WorkerTimeout of the silent ranks, with their stacks, and with the
        exceptions of the ranks that raised meanwhile (errors.timeout_error); ``seq``,
        ``method``: the call that timed out (None: outside a call).  ``failures``: the
        silent ranks' records, then the raising ranks'."""
        assert self.ranks is not None
        raised = {}
        for rank, (header, body) in sorted(replies.items()):
            if header.get(Field.STATUS) == Status.RAISED:
                raised[rank] = (ErrorRecord.parse(header.get(Field.ERROR)),
                                (body[0] if body else b"") or None)
        bound = {"start()": " (start_timeout: raise it if load() really takes longer)",
                 "restart()": " (restart(timeout=), start_timeout by default: raise it if "
                              "load() really takes longer)"}.get(what, "")
        report = self.collectives(seq, self.ranks.dead(), {
            r: record.type.rpartition(".")[2] for r, (record, _) in raised.items()}) \
            if seq is not None else None
        asked, deadline = self.ask_recorders() if seq is not None else ({}, 0.0)
        stacks = self.ranks.stacks(silent)  # the recorders answer meanwhile
        error = timeout_error(f"no answer from rank {', '.join(map(str, silent))} within "
                              f"{timeout:g} s during {what}{bound}", raised,
                              stacks, report, self.recorders(asked, deadline))
        error.failures = (
            self.ranks.failures(silent, self.devices, seq=seq, method=method) +
            self.ranks.failures(list(raised), self.devices, seq=seq, method=method,
                                errors=error.rank_errors, answered=True))
        self.with_collectives(error, report)
        return error

    def not_taken(self, timeout: float | None, what: str,
                  busy: Sequence[int] = (), seq: int | None = None,
                  method: str | None = None) -> WorkerTimeout:
        """The WorkerTimeout of a command that no rank got within ``timeout`` because one
        rank's pipe stayed full (Bus.publish's CommandBlocked): the ranks named are the
        stopped ones, else those still running an earlier call (``busy``), else all (ZeroMQ
        does not say whose pipe it is); their records in ``failures``."""
        assert self.ranks is not None and self.bus is not None
        stopped = [r for r, p in enumerate(self.ranks.procs) if p.stopped()]
        suspects = stopped or list(busy) or list(range(self.world_size))
        which = "stopped" if stopped else "still running an earlier call" \
            if busy else "one of them"
        headline = (f"{what} was sent to no rank within {timeout:g} s: a rank has not "
                    f"taken up its last {self.bus.bound} commands (rank "
                    f"{', '.join(map(str, suspects))}: {which})")
        error = timeout_error(headline, {}, self.ranks.stacks(suspects))
        error.failures = self.ranks.failures(suspects, self.devices, seq=seq, method=method)
        return error

    # -- end -----------------------------------------------------------------------------
    def end_ranks(self) -> None:
        """A restart failed: every rank ends now (the bus and files stay until close())."""
        self._ending()
        if self.ranks is not None:
            self.placement.end_ranks(self.ranks)

    def close(self, graceful: bool) -> None:
        """End every process and remove every file; safe to call in any state, twice."""
        if os.getpid() != self.owner_pid:
            return
        self.spares.stop()
        self._ending()
        if self.ranks is not None:
            # Exits are expected from here on: no death notices.
            self.ranks.watch.close()
            grace = 0.0
            procs = self.ranks.procs
            if graceful and procs and all(p.alive() for p in procs) and self.bus is not None:
                # A SHUTDOWN that finds a full pipe waits within the grace period; if it
                # cannot be sent then, the ranks are ended without it (SIGTERM, SIGKILL).
                began = time.monotonic()
                with contextlib.suppress(zmq.ZMQError, CommandBlocked):
                    if self.drop_through:  # calls in flight failed: not run before leaving
                        self.bus.publish({Field.KIND: Kind.DROP, Field.SEQ: self.drop_through},
                                         deadline=began + self.shutdown_grace)
                    self.bus.publish({Field.KIND: Kind.SHUTDOWN, Field.SEQ: 0},
                                     deadline=began + self.shutdown_grace)
                    grace = max(self.shutdown_grace - (time.monotonic() - began), 0.0)
            self.placement.close(self.ranks, grace)
            log.info("shut down %d rank%s (%s)", len(procs), "s" if len(procs) != 1 else "",
                     "gracefully" if grace else "without grace")
        self.spares.close()  # a SHUTDOWN sent above reached them too; before the bus
        if self.releaser is not None:
            self.results.notify = lambda: None  # results may outlive us: no stale pipe
            self.releaser.close()  # before the bus: it may be publishing
            self.releaser = None
        if self.bus is not None:
            self.bus.close()
            self.bus = None
        if self.ipc_dir is not None:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)
            self.ipc_dir = None
            os.close(self._dir_lock)
        self.inputs.close()
        self.results.close()
        for segment in self.rings:
            segment.close()
        self.rings = []
        segments.remove_prefix(self.shm_dir, self.shm_prefix)  # the lock file too (the rings)
        if self._owner_lock >= 0:
            os.close(self._owner_lock)
            self._owner_lock = -1
        if self._holds_templates:
            self._holds_templates = False
            Template.let_go()

