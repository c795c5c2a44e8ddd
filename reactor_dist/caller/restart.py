"""Restart, in one module: ``runner.restart()``, the budget with which a broken runner
restarts itself, the ranks' side of one restart, and the supervisor's steps in it.

A restart moves the call queue's state (:mod:`reactor_dist.caller.call_queue`, where the
moves are)::

    healthy / unusable --restart()--> restarting --ranks back--> healthy
                                          |
                                          +--- it failed, or was interrupted --> unusable
                                               (what start() would raise; every rank ended)

While ``restarting``, every new call waits for the end (at most its
``queue_timeout``).  With ``max_restarts=N`` a crash, a timeout or a desync still fails
the call it happened in and every call behind it (a step is never replayed), and the
runner restarts itself at once, in a thread of its own; past N restarts within
``restart_window`` seconds it stays unusable, and its error lists the failures that
used the budget (a crash loop must not spin).  :class:`Restarts` is the policy and the
driver: it asks the queue for each move and never writes its state.

The ranks' side of one restart (:func:`restart`; the call queue holds every call
meanwhile), with the supervisor's steps in it (:func:`abort_groups`, :func:`new_epoch`,
:func:`take_spares`, :func:`replace`, :func:`remove_old_stores`)::

    caller                                                ranks
    DROP (SEQ: the last call sent) ------------------->  each skips calls up to it
    GROUP_ABORT_SIGNAL to each live rank (rejoin()) -->  closes the old group's
                                                          connections: every collective
                                                          of the failed step raises
    a new epoch: the old death watch ends, its notices are stale
    who keeps its model (only if the worker defines rejoin() and the DROP went out to
      every rank: a full pipe refuses it to all, XPUB_NODROP): alive, and answers
      a PING within the grace period (one that does not is stopped, or hangs in the
      model's own code; a rank known dead is not waited for, nor one whose CUDA
      context broke: supervisor.lost)
    end the others; forget what they held (rank 0 ended: its result segments go)
    a loaded spare takes an ended rank's place, while there is one (spares.py)
    start a replacement per other ended rank (same rank, GPU, Ray bundle)
    PING -> PONG from each replacement (rank 0's: its store port across nodes)
    rank 0 kept or taken: REJOIN [0] -> PROGRESS (its new store's port)
    REJOIN [kept, taken], INIT [replaced] (EPOCH, PORT) ->  kept: leave the old group,
                                                           join the new, rejoin()
                                                          spare (TAKERS): becomes the
                                                           rank, joins, rejoin()
                                                          replaced: join, load()
    REJOINED (kept), READY (replaced) <----------------

A kept rank keeps its process and its worker object: its tensors, weights, compiled
code and caches.  It must rebuild in ``rejoin()`` whatever depends on the old group:
sub-groups, communicators, and any state of the step that failed.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from .. import timeouts
from ..errors import WorkerTimeout
from ..shm import segments
from ..wire.protocol import GROUP_ABORT_SIGNAL, Field, Kind, result_tag, store_file
from .bus import CommandBlocked
from .call_queue import CallQueue
from .fault_log import first_line, headline, one_line
from .spares import Spare
from .supervisor import Ask, Supervisor, raise_first_error

log = logging.getLogger("reactor_dist")
END_WAIT = 30.0  # seconds restart() waits for a failed restart of its own to end its ranks


def told(done: Restarted) -> str:
    """What a restart did, for its log record: who got a new process, who was kept."""
    parts = []
    if done.replaced:
        parts.append(f"new process and load() for rank {', '.join(map(str, done.replaced))}")
    if done.taken:
        parts.append(f"a loaded spare took the place of rank "
                     f"{', '.join(map(str, done.taken))} (rejoin(), no load())")
    if done.kept:
        parts.append(f"rank {', '.join(map(str, done.kept))} kept its model (rejoin())")
    if not done.kept:
        parts.append("no rank kept its model")
    return "; ".join(parts)


class Restarts:
    """How many restarts so far, the budget, and the restart itself, of one runner."""

    def __init__(self, queue: CallQueue, *, rejoin: bool, grace: float, max_restarts: int,
                 window: float, timeout: float | None) -> None:
        self.queue, self.rejoin, self.grace = queue, rejoin, grace
        self.max_restarts, self.window, self.timeout = max_restarts, window, timeout
        self.count = 0
        self.spent: collections.deque[tuple[float, BaseException]] = collections.deque()
        self.exhausted: list[BaseException] = []  # the budget's failures, once used up
        self.thread: threading.Thread | None = None
        self.last: Restarted | None = None

    def after_failure(self, exc: BaseException) -> str | None:
        """As the runner breaks with ``exc`` (the engine asks; it only decides): None, or
        it restarts itself (the engine moves to ``restarting`` and asks its driver to
        :meth:`start` it) and this note goes on the failed calls' errors (the engine says
        what becomes of each call)."""
        if self.max_restarts <= 0:
            return None
        now = time.monotonic()
        while self.spent and now - self.spent[0][0] > self.window:
            self.spent.popleft()
        if len(self.spent) >= self.max_restarts:
            self.exhausted = [e for _, e in self.spent] + [exc]
            return None
        self.spent.append((now, exc))
        return (f"the runner is restarting (restart {len(self.spent)} of "
                f"max_restarts={self.max_restarts} within {self.window:g} s): the next call "
                f"waits for it")

    def start(self) -> None:
        """Under the queue's lock: the restart that after_failure() allowed, in a thread
        of its own (it waits for the lock, and takes the reply socket over)."""
        self.thread = threading.Thread(target=self.in_background, daemon=True,
                                       name="reactor-dist-restart")
        self.thread.start()

    def stop(self) -> None:
        """Shutdown: a restart in progress gives up (within a beat) before anything ends."""
        self.queue.supervisor.begin_closing()
        thread = self.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=10)

    def in_background(self) -> None:
        try:
            self.run(self.timeout)
        except BaseException as exc:  # the queue is unusable with it; the log says why
            log.error("the runner could not restart: %s: %s", type(exc).__name__,
                      one_line(exc))

    def run(self, timeout: float | None) -> None:
        """Bring the ranks back (the queue is ``restarting``).  On a failure, or an
        interrupt anywhere in it, the queue is unusable with that failure first and then
        every rank is ended: restart() and shutdown() both work at once after it."""
        queue = self.queue
        supervisor = queue.supervisor
        thread = self.thread
        if thread is not None and thread is not threading.current_thread():
            # restart() right after a restart of its own failed: that one ends its ranks
            # after it moved the queue to unusable; this one starts once they are ended.
            thread.join(timeout=END_WAIT)
        try:
            last_seq, why = queue.take_over_for_restart()
            path = queue.path
            assert path is not None

            def other(header: dict) -> None:  # a message of the calls that failed
                with queue.lock:
                    path.arrived(header)
                    path.discard(header)

            deadline = timeouts.deadline_of(timeout)
            done = restart(supervisor, rejoin=self.rejoin, grace=self.grace,
                           timeout=timeout, last_seq=last_seq, other=other)
            session, replayed = queue.session, ""
            if session is not None:  # every rank restores the snapshot; the calls since
                path.ranks = supervisor.ranks
                session.renewed(done.replaced + done.taken)
                kept, seconds = len(session.journal), session.replay(path, deadline)
                done = done._replace(seconds=done.seconds + seconds)
                replayed = (f"; every rank restored the snapshot and ran the {kept} call"
                            f"{'s' * (kept != 1)} since it again")
            again = [call.what for call, _ in queue.engine.retrying]  # sent once this returns
            if again:
                replayed += f"; {', '.join(again)} sent again (retry_failed)"
            self.count += 1
            self.last = done
            reason = f" after {headline(why)}" if why else ""
            log.warning("restart %d%s in %.2f s: %s%s", self.count, reason, done.seconds,
                        told(done), replayed,
                        extra={"restart": self.count, "replaced": done.replaced,
                               "kept": done.kept, "taken": done.taken,
                               "restart_seconds": done.seconds})
            queue.restart_ended(None)
        except BaseException as exc:
            if queue.restart_ended(exc):
                supervisor.end_ranks()
            raise

    def budget_note(self) -> str:
        """The failures that used the budget, for the unusable runner's error."""
        if not self.exhausted:
            return ""
        listed = "; ".join(f"{i}. {type(e).__name__}: {first_line(e)}"
                           for i, e in enumerate(self.exhausted, 1))
        return (f" ({len(self.exhausted)} failures within {self.window:g} s, over "
                f"max_restarts={self.max_restarts}: {listed})")


# -- one restart, the ranks' side ------------------------------------------------------
class Restarted(NamedTuple):
    """What one restart did (for the log record and ``stats()``)."""

    replaced: list[int]  # ranks that got a new process and ran load()
    kept: list[int]  # ranks that kept their process and model (rejoin())
    seconds: float
    taken: list[int] = []  # ranks whose place a loaded spare took (rejoin(), no load())


def restart(supervisor: Supervisor, *, rejoin: bool, grace: float, timeout: float | None,
            last_seq: int, other: Callable[[dict[str, Any]], None]) -> Restarted:
    """Replace the ranks that are gone (every rank, without ``rejoin``); raises what
    start() would, or WorkerCrashed / WorkerTimeout."""
    began = time.monotonic()
    deadline = timeouts.deadline_of(timeout)
    bus, ranks = supervisor.bus, supervisor.ranks
    assert bus is not None and ranks is not None
    # A rank's full pipe refuses the DROP to every rank (XPUB_NODROP: all or none): then
    # no rank may keep its model, since a kept rank would run the failed calls first.
    try:  # one try: no time of the restart's goes to a stopped rank's pipe
        dropped = bus.publish({Field.KIND: Kind.DROP, Field.SEQ: last_seq},
                              deadline=time.monotonic())
    except CommandBlocked:
        dropped = False
    # A rank whose CUDA context broke runs, but is replaced as the dead are.
    alive = [r for r, proc in enumerate(ranks.procs)
             if proc.alive() and r not in supervisor.lost]
    if rejoin and dropped:  # the survivors leave the failed step, wherever they wait in it
        abort_groups(supervisor, alive)
    new_epoch(supervisor)  # deaths from here on are this restart's business
    kept = responsive(supervisor, alive, min(grace, max(deadline - began, 0.0)), other) \
        if rejoin and alive and dropped else []
    gone = [r for r in range(supervisor.world_size) if r not in kept]
    takers = take_spares(supervisor, gone) if rejoin else {}  # the first ranks get them
    replace(supervisor, gone, takers)
    supervisor.lost.clear()
    replaced = [r for r in gone if r not in takers]
    epoch = supervisor.epoch
    pongs = supervisor.ping(frozenset(replaced), deadline, timeout, "restart()", other)
    port = (pongs[0][0].get(Field.PORT) or 0) if 0 in pongs else 0
    joining = sorted(kept + list(takers))  # each keeps its model: REJOIN, rejoin()
    address = supervisor.placement.store_address()  # rank 0's node now (a spare's?)

    def rejoin_command(ranks: list[int]) -> dict[str, Any]:
        command = {Field.KIND: Kind.REJOIN, Field.SEQ: 0, Field.EPOCH: epoch,
                   Field.RANKS: ranks,
                   Field.TAKERS: [[takers[r].slot, r] for r in ranks if r in takers]}
        if address:
            command[Field.ADDRESS] = address
        return command

    progress = frozenset({Kind.PROGRESS})
    if 0 in joining:  # rank 0 opens the new group's store first (across nodes: a new port)
        opened = supervisor.exchange([Ask(rejoin_command([0]), Kind.PROGRESS, frozenset({0}))],
                                     deadline - time.monotonic(), timeout, "restart()",
                                     other=other)
        port = opened[0][0].get(Field.PORT) or 0
    asks = [Ask({Field.KIND: Kind.INIT, Field.SEQ: 0, Field.EPOCH: epoch, Field.PORT: port,
                 Field.RANKS: replaced}, Kind.READY, frozenset(replaced), progress)]
    if joining:
        others = [r for r in joining if r != 0]
        asks.append(Ask({**rejoin_command(others), Field.PORT: port},
                        Kind.REJOINED, frozenset(others), progress))
        if 0 in joining:  # has its REJOIN: nothing more to send it
            asks.append(Ask({}, Kind.REJOINED, frozenset({0}), progress))
    answers = supervisor.exchange(asks, deadline - time.monotonic(), timeout, "restart()",
                                  first_error=True, other=other)
    raise_first_error(answers)
    remove_old_stores(supervisor)
    for rank in replaced:
        seconds = answers[rank][0].get(Field.LOAD_SECONDS)
        if isinstance(seconds, float):
            supervisor.load_seconds[rank] = seconds
    return Restarted(replaced, kept, time.monotonic() - began, sorted(takers))


def responsive(supervisor: Supervisor, alive: list[int], grace: float,
               other: Callable[[dict[str, Any]], None]) -> list[int]:
    """The ranks of ``alive`` that answer a PING within ``grace`` seconds: a rank still
    inside the failed step (a collective with a peer that is gone) answers once it
    leaves it; one that does not in time is replaced."""
    try:
        pongs = supervisor.ping(frozenset(alive), time.monotonic() + grace, grace,
                               "restart()", other, partial=True)
    except WorkerTimeout:
        return []
    return sorted(r for r in pongs if supervisor.ranks.procs[r].alive())  # type: ignore[union-attr]


# -- the supervisor's steps in it ------------------------------------------------------
def abort_groups(supervisor: Supervisor, ranks: list[int]) -> None:
    """restart(): each of ``ranks`` (alive) gets out of whatever collective of the
    failed step it waits in: the old group's connections close on all of them at
    once, so that a survivor waiting on another survivor is released by it too
    (reactor_dist.rank.group).  Only for the runner's own group."""
    procs = supervisor.ranks
    if supervisor.forms_group and supervisor.world_size > 1 and procs is not None:
        for rank in ranks:
            procs.procs[rank].signal(GROUP_ABORT_SIGNAL, group=False)


def remove_old_stores(supervisor: Supervisor) -> None:
    """A restart formed the group of ``epoch``: the stores of the generations before
    it go (nobody meets there any more)."""
    if supervisor.ipc_dir is not None:
        for epoch in range(supervisor.epoch):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(supervisor.ipc_dir, store_file(epoch)))


def new_epoch(supervisor: Supervisor) -> None:
    """A restart begins: the old death watch ends, and its notices are stale from now
    on (a notice names the generation it watched)."""
    assert supervisor.ranks is not None
    supervisor.ranks.watch.close()
    supervisor.epoch += 1


def take_spares(supervisor: Supervisor, gone: list[int]) -> dict[int, Spare]:
    """restart(): the loaded spares that take the places of the ``gone`` ranks, by
    rank; a spare that shares a rank's GPU takes only that rank's (spares.match)."""
    return supervisor.spares.take(gone, supervisor.place_of, supervisor.placement.gpu_of)


def replace(supervisor: Supervisor, ranks: list[int], takers: dict[int, Spare]) -> None:
    """restart(), in a new ``epoch``: ``ranks`` end; each of them that a spare of
    ``takers`` takes has that spare's process from now on (in the spare's place: the
    rank's goes to a new spare, started in the background), every other one a new
    process (same rank, GPU, bundle); the others keep theirs, under a new death watch.
    What the ended ranks held is forgotten (rank 0's result segments too)."""
    old = supervisor.ranks
    assert old is not None
    old.watch.close()
    old.end_replaced(ranks)
    freed = []
    for rank, spare in takers.items():
        spare.proc.become(rank)
        old.procs[rank] = spare.proc  # kept from here on, as a survivor is
        freed.append(supervisor.place_of[rank])
        supervisor.place_of[rank] = spare.place
        if spare.device is not None and rank < len(supervisor.devices):
            supervisor.devices[rank] = spare.device
        if spare.load_seconds is not None:
            supervisor.load_seconds[rank] = spare.load_seconds
    supervisor.ranks = supervisor.new_ranks()
    supervisor.inputs.forget(ranks)
    if 0 in ranks:
        supervisor.results.unmap_unused()
        segments.remove_starting(supervisor.shm_dir, f"{supervisor.shm_prefix}.{result_tag(0)}")
    supervisor.placement.restart([r for r in ranks if r not in takers], old, supervisor.ranks,
                                 supervisor.bootstrap)
    supervisor.spares.start_later(freed)
