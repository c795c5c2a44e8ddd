"""The call queue: the caller's one state machine.

It owns everything about calls on the caller's side: the runner's :class:`State`, the
order of calls and the turns of the threads and tasks that make them, the calls in
flight, who reads the reply socket, the deadlines, and the collector thread.  Every
form of call (``generate``, ``submit``, ``stream``, ``reset`` and their asyncio forms)
is a thin adapter over it (:mod:`reactor_dist.caller.blocking`, :mod:`reactor_dist.caller.aio`,
:mod:`reactor_dist.caller.stream`).  Two calls in flight::

    callers (threads, tasks)       CallQueue (one lock)                ranks
    submit(a) -- turn 1 ------->   CallPath.send: CALL 7 ----------->  run 7
    submit(b) -- turn 2 ------->   CallPath.send: CALL 8 ----------->  (8 waits behind 7)
    submit(c) -- turn 3: waits     in flight [7, 8] = max_in_flight
    whoever waits receives   <--   dispatch by seq: REPLY 7 (rank 0)   <-- REPLY 7
      (one receiver at a time;     REPLY 7 (rank 1): 7 answered:       <-- REPLY 7
      the collector thread when      judged, its future settled;
      nobody else will)              8 starts its clock; turn 3 sends
                                   CALL 9 ------------------------->

The states and the only moves between them (:data:`MOVES`; :meth:`CallQueue.move` is
the one place the state changes, and an illegal move is a bug that raises)::

    new --start()--> healthy --crash / timeout / desync--> unusable
     |                ^   |  \\                               |
     |                |   |   +--(max_restarts)--+            | restart()
     |                |   +------ restart() -----+-> restarting <-+
     |                +------------------------------------+   |
     |                                   a restart that failed: unusable
     +----------- shutdown() (or a failed start()) from any state ---------> closed

The ranks run calls strictly in the order sent.  A call's ``timeout`` bounds, from
when the ranks start it, its wait for each reply or item; a rank that raised in a call
starts the next one only once every rank answered it (Kind.ANSWERED), so that no
collective of one call pairs with another's.  A crash, a timeout or a desync breaks
the runner: that call and every call behind it fail with that type of error (their
messages name the call that broke it); a call whose every rank raised the same type
fails alone.  A call that is left (nobody takes its answer any more: Ctrl-C, a cancelled task,
a stream closed early) stays in flight until the ranks answer it; its answer is
discarded.  While the runner restarts, every call form waits for the end (at most its
``queue_timeout``), a caller that was already waiting for its turn included.

One PULL socket carries the answers of every call in flight, so one caller at a time
receives (``receiving``) and dispatches each message to its call by sequence number;
the others wait on a condition (threads) or a :class:`Waker` (tasks) that every
dispatch wakes.  A thread blocks in ZeroMQ with the lock released; a task only takes
what has arrived and then awaits the socket's descriptor, so the loop never blocks.
When calls are in flight that no caller is watching, the collector thread receives for
them, so that futures settle, crashes are reported and left answers go back at once.
Only a receiver that found nothing more to read declares a deadline passed.

The lock guards everything here and both ledgers; only the blocking receive itself
runs outside it.  Futures are settled outside it, so that their callbacks may call
the runner.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from time import perf_counter
from typing import Any, Protocol

import zmq

from .. import timeouts
from ..errors import CallQueueFull, WorkerCrashed, WorkerTimeout, failed_behind, queue_full
from ..wire.protocol import Field, Kind, Method
from .calls import Call, CallPath, collective_wait_seconds, compute_seconds
from .fault_log import one_line
from .observers import (
    CANCELLED,
    CRASHED,
    DESYNC,
    OK,
    RAISED,
    TIMED_OUT,
    CallEnd,
    CallRecord,
    Observer,
    tell,
)
from .outcome import UNUSABLE_ENDING, judge
from .session import Session
from .supervisor import Supervisor
from .timings import Recorder

WAKE = 0.25  # seconds: the longest one receive or wait lasts before its waiter looks again
WAKE_MS = timeouts.wait_ms(WAKE)
POLLIN = int(zmq.POLLIN)  # a plain int: pyzmq's flag enums cost microseconds a test
DRAIN_MOST = 64  # messages one asyncio poll takes before it lets the loop run
# Seconds a death's notice waits for the replies a dead rank sent before it died
# (CallQueue.last_replies): the ring says they were sent; without a ring, a short look.
LAST_REPLIES = 0.5
LAST_REPLIES_UNKNOWN = 0.05


class State(enum.Enum):
    """The runner's state; only ``HEALTHY`` sends calls."""

    NEW = "new"
    HEALTHY = "healthy"
    RESTARTING = "restarting"
    UNUSABLE = "unusable"
    CLOSED = "closed"

    def __str__(self) -> str:
        return self.value


NEW, HEALTHY, RESTARTING, UNUSABLE, CLOSED = (
    State.NEW, State.HEALTHY, State.RESTARTING, State.UNUSABLE, State.CLOSED)

# Every allowed move: start() succeeded; broke (with the restart budget: restarting);
# restart(); a restart ended (back, or failed); shutdown() or a failed start().
MOVES: dict[State, frozenset[State]] = {
    NEW: frozenset({HEALTHY, CLOSED}),
    HEALTHY: frozenset({UNUSABLE, RESTARTING, CLOSED}),
    RESTARTING: frozenset({HEALTHY, UNUSABLE, CLOSED}),
    UNUSABLE: frozenset({RESTARTING, CLOSED}),
    CLOSED: frozenset(),
}
_KEEP: Any = object()  # move(): the failure stays what it was


class Waker:
    """Wakes one waiting task: from its loop's thread at once, from others through
    the loop; a wake before the wait is kept, so none is lost."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.thread = loop, threading.get_ident()
        self.flag = False
        self.woken: asyncio.Future | None = None

    def wake(self) -> None:
        if threading.get_ident() == self.thread:
            self.set()
        else:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody can take it
                self.loop.call_soon_threadsafe(self.set)

    def set(self) -> None:
        self.flag = True
        if self.woken is not None and not self.woken.done():
            self.woken.set_result(None)

    async def wait(self, until: float | None) -> None:
        """Until woken, or the monotonic ``until`` (at most WAKE from now)."""
        if self.flag:
            self.flag = False
            return
        self.woken = woken = self.loop.create_future()
        delay = WAKE if until is None else min(max(until - time.monotonic(), 0.0), WAKE)
        timer = self.loop.call_later(delay, self.set)
        try:
            await woken
        finally:
            self.woken, self.flag = None, False
            timer.cancel()



log = logging.getLogger("reactor_dist")
NOT_REPLAYED = "this call is not replayed"
SENT_AGAIN = "this call is sent again after it (retry_failed)"
SENT_TWICE = "this call was sent again once already: retry_failed sends a call once"


def say_restarting(error: BaseException, note: str, then: str = NOT_REPLAYED) -> None:
    """An automatic restart began: its note, and ``then`` (what becomes of the call), go
    into the error's message, where an application that logs ``str(error)`` sees it (a
    RankDesync's "unusable" ending gives way to it); once."""
    message = str(error)
    if note not in message:
        error.args = (f"{message.removesuffix(UNUSABLE_ENDING)}; {note}; {then}",)

class RestartPolicy(Protocol):
    """What the call queue asks of the restart budget (restart.Restarts)."""

    def after_failure(self, exc: BaseException) -> str | None:
        """As the runner breaks: None, or the note of the restart it begins."""

    def budget_note(self) -> str:
        """The failures that used the budget, for an unusable runner's error."""


class NoRestarts:
    """max_restarts=0: a failure leaves the runner unusable."""

    def after_failure(self, exc: BaseException) -> str | None:
        return None

    def budget_note(self) -> str:
        return ""


class CallQueue:
    """Calls in send order, at most ``max_in_flight`` of them sent and not answered.
    ``session`` (snapshot_every=) and ``retry_failed`` are given when it is made, and so
    is its restart budget: ``restarts(queue)`` makes it (the restarts drive this queue)."""

    def __init__(self, supervisor: Supervisor, max_in_flight: int, timings: Recorder, *,
                 session: Session | None = None, retry_failed: bool = False,
                 restarts: Callable[[CallQueue], RestartPolicy] | None = None) -> None:
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)  # something arrived, a turn moved
        self.wanted = threading.Condition(self.lock)  # a call has nobody waiting for it
        self.supervisor, self.max_in_flight, self.timings = supervisor, max_in_flight, timings
        self.world_size = supervisor.world_size
        self.path: CallPath | None = None
        self.state = NEW
        self.failure: BaseException | None = None  # why it is not healthy
        self.in_flight: collections.deque[Call] = collections.deque()
        self.by_seq: dict[int, Call] = {}
        self.turns: collections.deque[object] = collections.deque()  # callers waiting to send
        self.settled: collections.deque[Call] = collections.deque()  # futures to settle
        self.leaving: collections.deque[Call] = collections.deque()  # leave_soon()'s
        self.observers: tuple[Observer, ...] = ()  # metrics, traces (observers.py)
        self.receiving = False  # a caller owns the reply socket now
        self.dying = False  # a death's notice waits for the dead ranks' last replies
        self.sending = False  # a caller is between encode and publish
        self.waiting = 0  # threads in changed.wait() (none: no notify to pay for)
        self.wakers: list[Waker] = []
        self.readers: dict[asyncio.AbstractEventLoop, int] = {}  # tasks waiting, per loop
        self.collector: threading.Thread | None = None
        # Sessions (reactor_dist.caller.session, snapshot_every=): snapshots and the calls kept;
        # with retry_failed, the calls a fault failed wait here, with their errors, to be
        # sent again once the automatic restart is done.
        self.session, self.retry_failed = session, retry_failed
        self.retrying: list[tuple[Call, BaseException]] = []
        self.retried = 0  # calls sent again after a restart, so far
        # The restart budget (restart.py): asked as the runner breaks.
        self.restarts = restarts(self) if restarts is not None else NoRestarts()

    # -- observers -------------------------------------------------------------------------
    def attach(self, observer: Observer) -> None:
        """``observer`` hears of every call from now on (metrics, traces)."""
        with self.lock:
            if observer not in self.observers:
                self.observers = (*self.observers, observer)

    def detach(self, observer: Observer) -> None:
        with self.lock:
            self.observers = tuple(o for o in self.observers if o is not observer)

    def tell_observers(self, hook: str, *args: Any) -> None:
        """Outside the lock: every observer's ``hook`` (one that raises is dropped)."""
        if self.observers:
            observers = tell(self.observers, hook, *args)
            with self.lock:
                self.observers = observers

    # -- states ----------------------------------------------------------------------------
    def move(self, to: State, failure: BaseException | None = _KEEP) -> None:
        """Under the lock: the one place the state changes; every waiter looks again."""
        if to not in MOVES[self.state]:
            raise RuntimeError(f"reactor_dist bug: the runner's state cannot move from "
                               f"{self.state} to {to}")
        self.state = to
        if failure is not _KEEP:
            self.failure = failure
        self.changed_all()

    def open(self) -> None:
        """start() succeeded: calls may go."""
        with self.lock:
            self.path = CallPath(self.supervisor, self.wait_while_sending, self.busy)
            self.supervisor.start_releaser(self.path.memory.pass_on_releases,
                                          lambda: self.path.last_sent)  # type: ignore[union-attr]
            self.move(HEALTHY, None)

    def start_failed(self, exc: BaseException) -> None:
        with self.lock:
            self.move(CLOSED, exc)

    def check_usable(self) -> None:
        """Raise why no call can go now (nothing, when healthy)."""
        state = self.state
        if state is HEALTHY:
            return
        if state is NEW:
            raise RuntimeError("start() has not run: call runner.start() (or use `with runner:`)")
        failure = self.failure
        if state is RESTARTING:  # a caller that waits for the end never gets here
            raise RuntimeError(f"this DistributedRunner is restarting after "
                               f"{type(failure).__name__}: wait for it") from failure
        if failure is None:
            raise RuntimeError("this DistributedRunner is unusable (it was shut down); build "
                               "and start a new one")
        then = "It was shut down; build and start a new one" if state is CLOSED else \
            "runner.restart() brings its ranks back (DistributedRunner(max_restarts=N) " \
            "restarts it by itself)"
        said = str(failure).removesuffix(UNUSABLE_ENDING)
        raise RuntimeError(f"this DistributedRunner is unusable: {type(failure).__name__}: "
                           f"{said}{self.restarts.budget_note()}. {then}") from failure

    def broken(self, exc: BaseException, at: Call | None = None,
               raised: bool = False) -> None:
        """The runner is unusable from now on (or restarts itself, if the budget allows):
        ``at`` (default: the call the ranks run) fails with ``exc``, every other call in
        flight with the same type of error.  ``raised``: a caller gets ``exc`` itself.
        The fault's one log line: ERROR when a caller sees it, WARNING when none does
        (retry_failed sends the failed calls again after the restart it begins)."""
        if self.state is not HEALTHY:
            return
        self.supervisor.take_output()  # the failed calls' log records before their errors
        said = one_line(exc)  # before the restart's note goes into its message
        note = self.restarts.after_failure(exc)
        self.move(UNUSABLE if note is None else RESTARTING, exc)
        at = at or (self.in_flight[0] if self.in_flight else None)
        if isinstance(exc, WorkerCrashed) and self.observers:
            self.observers = tell(self.observers, "died", self.supervisor.dead())
        seen = self.fail_in_flight(lambda call: exc if call is at else failed_behind(
            exc, call.what, at.what if at is not None else None), note,
            CRASHED if isinstance(exc, WorkerCrashed) else
            TIMED_OUT if isinstance(exc, WorkerTimeout) else DESYNC,
            retry=note is not None and self.retry_failed)
        if note is not None:  # raised by a call not yet in flight (a death while idle)
            say_restarting(exc, note, SENT_AGAIN if self.retry_failed else NOT_REPLAYED)
        if note is None or seen or raised:
            log.error("%s", said if note is None else f"{said}; {note}")
        else:  # no caller saw it
            again = ", ".join(call.what for call, _ in self.retrying)
            log.warning("%s; %s; %s", said, note,
                        f"retry_failed sends {again} again: no caller saw an error" if again
                        else "no call failed: no caller saw an error")

    def fail_in_flight(self, error_of: Callable[[Call], BaseException],
                       note: str | None = None, outcome: str = CANCELLED,
                       retry: bool = False) -> int:
        """Every call in flight fails; the callers waiting for a turn keep it (they wait
        for a restart, or see why they cannot send).  ``retry`` (retry_failed, an
        automatic restart begins): a call somebody takes, sent once so far, waits to be
        sent again instead, its error kept for a restart that fails.  How many errors a
        caller takes."""
        seen = 0
        for call in self.in_flight:
            if not call.done:
                error = error_of(call)
                again = retry and not call.left and not call.retried and \
                    call.command is not None
                if note is not None:
                    say_restarting(error, note, SENT_AGAIN if again else
                                   SENT_TWICE if retry and call.retried else NOT_REPLAYED)
                if call.method == Method.SNAPSHOT:
                    call.settle(None, error)  # the caller's own: the last snapshot stays
                elif again:
                    self.retrying.append((call, error))
                else:
                    seen += not call.left
                    self._settle(call, None, error, outcome)
        self.in_flight.clear()
        self.by_seq.clear()
        self.changed_all()
        return seen

    def begin_restart(self) -> None:
        """restart() from the caller: the calls in flight fail; new ones wait for it."""
        with self.lock:
            if self.state is CLOSED:
                raise RuntimeError("this DistributedRunner was shut down: restart() brings "
                                   "back a runner that broke, not one shut down; build a new one")
            if self.state is NEW:
                raise RuntimeError("start() has not run: call runner.start() first")
            while self.state is RESTARTING:  # a restart of its own (max_restarts) runs
                self.wait(WAKE)
            if self.state is HEALTHY:
                self.fail_in_flight(lambda call: RuntimeError(
                    f"{call.what} was in flight when runner.restart() was called: it has "
                    f"no result"))
                self.move(RESTARTING, None)
            else:
                self.move(RESTARTING)

    def take_over_for_restart(self) -> tuple[int, BaseException | None]:
        """A restart begins its work: nobody receives any more (the restart's exchanges
        read the socket); the last call sent, and why the runner restarts."""
        with self.lock:
            self.wait_for_receiver()
            assert self.path is not None
            seq, why = self.path.seq, self.failure
        self.stop_collector()
        return seq, why

    def restart_ended(self, failure: BaseException | None) -> bool:
        """The restart ended: healthy again, or unusable with ``failure``; False if it
        had ended already (shut down meanwhile, or this very call moved it)."""
        with self.lock:
            if self.state is not RESTARTING:
                return False
            if failure is None:
                assert self.path is not None and self.supervisor.ranks is not None
                self.path.ranks = self.supervisor.ranks
                self.move(HEALTHY, None)
                self.send_retries()
            else:
                self.move(UNUSABLE, failure)
                self.fail_retries(lambda error: f"{error}; the runner restarted to send this "
                                  f"call again, and the restart failed: "
                                  f"{type(failure).__name__}: {failure}")
        self.settle_futures()  # the calls that failed here: no collector runs for them now
        return True

    def send_retries(self) -> None:
        """Under the lock, healthy again after an automatic restart: the calls the fault
        failed go again, in their order and before any other (retry_failed)."""
        retrying, self.retrying = self.retrying, []
        path = self.path
        assert path is not None
        for index, (call, _) in enumerate(retrying):
            try:
                assert call.command is not None
                seq = path.send_again(call.command, bool(self.in_flight))
            except (WorkerCrashed, WorkerTimeout) as exc:
                self.retrying = retrying[index:]
                self.broken(exc, raised=True)  # a retried call is not sent again: they fail
                self.fail_retries(str)
                return
            call.resent(seq, perf_counter())
            self.retried += 1
            if call.timeout is not None and not self.in_flight:
                call.deadline = time.monotonic() + call.timeout
            self.in_flight.append(call)
            self.by_seq[seq] = call
            if call.watchers <= 0:
                self.want_collector()
            self.snapshot_if_due(call)
        self.changed_all()

    def fail_retries(self, message: Callable[[BaseException], str]) -> None:
        """The calls waiting to be sent again fail with the error the fault gave them."""
        retrying, self.retrying = self.retrying, []
        for call, error in retrying:
            error.args = (message(error),)
            self._settle(call, None, error, CANCELLED)

    def close(self) -> None:
        """Shut down: the calls in flight fail; waits until nobody is receiving."""
        with self.lock:
            if self.state is CLOSED:
                return
            if self.state is HEALTHY and self.in_flight and self.path is not None:
                # The ranks skip the calls that fail here, rather than run them first
                # (Supervisor.close sends the DROP, like SHUTDOWN, within the grace).
                self.supervisor.drop_through = self.path.seq
            self.move(CLOSED)
            self.fail_in_flight(lambda call: RuntimeError(
                f"{call.what} was still in flight when the runner was shut down: it has no "
                f"result"))
            self.fail_retries(lambda error: f"{error}; the runner was shut down before this "
                              f"call was sent again")
            self.wait_for_receiver()
            if self.session is not None:
                self.session.close()
        self.stop_collector()
        self.settle_futures()

    # -- sending ---------------------------------------------------------------------------
    def send(self, method: str, value: Any, timeout: float | None,
             queue_timeout: float | None, future: Future | None = None,
             stream: bool = False) -> Call:
        """:meth:`send_locked`, taking the lock; a ``future`` call has no waiter: the
        collector receives for it."""
        try:
            with self.lock:
                return self.send_locked(method, value, timeout, queue_timeout, future, stream)
        finally:
            self.settle_futures()  # a failure to send may have failed the calls in flight

    def send_locked(self, method: str, value: Any, timeout: float | None,
                    queue_timeout: float | None, future: Future | None = None,
                    stream: bool = False) -> Call:
        """Take a turn (first come, first served), wait for room in flight and for a
        restart in progress, at most ``queue_timeout`` (CallQueueFull), publish; a
        ``stream`` call's items are handed over as they come."""
        try:
            return self.send_once(method, value, timeout, queue_timeout, future, stream)
        except (WorkerCrashed, WorkerTimeout):
            # The fault was found as this call went (a death while idle): with
            # retry_failed it goes after the automatic restart, like the calls in flight.
            if not (self.retry_failed and self.state is RESTARTING):
                raise
        return self.send_once(method, value, timeout, queue_timeout, future, stream)

    def free_to_send(self) -> bool:
        """Under the lock: the fast path of threads and tasks alike: a call may go now,
        with no turn (no caller waiting for one, healthy, room in flight)."""
        return not self.turns and self.state is HEALTHY and \
            len(self.in_flight) < self.max_in_flight

    def send_once(self, method: str, value: Any, timeout: float | None,
                  queue_timeout: float | None, future: Future | None = None,
                  stream: bool = False) -> Call:
        if self.free_to_send():
            return self.send_now(None, method, value, timeout, future, stream)  # at once
        turn = self.take_turn()
        try:
            give_up = None if queue_timeout is None else time.monotonic() + queue_timeout
            if not self.pump(lambda: self.may_send(turn), give_up):
                raise self.not_sent(method, queue_timeout)
            return self.send_now(turn, method, value, timeout, future, stream)
        finally:
            self.leave_turn(turn)

    def take_turn(self) -> object:
        """Under the lock: a place in the line of callers waiting to send."""
        if self.state is not RESTARTING:
            self.check_usable()
        turn = object()
        self.turns.append(turn)
        return turn

    def may_send(self, turn: object) -> bool:
        """This caller may send now, or must look why not (the runner is not healthy and
        not restarting either: publish() raises why)."""
        state = self.state
        if state is HEALTHY:
            return self.turns[0] is turn and len(self.in_flight) < self.max_in_flight
        return state is not RESTARTING

    def not_sent(self, method: str, queue_timeout: float | None) -> CallQueueFull:
        if self.state is RESTARTING:
            return CallQueueFull(
                f"{method}() waited {queue_timeout:g} s for the runner's restart to end; "
                f"nothing was sent (the restart goes on)")
        return queue_full(method, queue_timeout, len(self.in_flight), self.max_in_flight,
                          self.in_flight[0].what if self.in_flight else "nothing")

    def leave_turn(self, turn: object) -> None:
        if turn in self.turns:
            first = self.turns[0] is turn
            self.turns.remove(turn)
            if first and self.turns:
                self.changed_all()

    def send_now(self, turn: object | None, method: str, value: Any, timeout: float | None,
                future: Future | None, stream: bool = False) -> Call:
        """Send now (our turn, room in flight); the call is in flight when this returns."""
        self.check_usable()
        assert self.path is not None
        self.sending = True
        try:
            call = self.path.send(method, value, timeout, bool(self.in_flight),
                                  keep=self.session is not None)
        except (WorkerCrashed, WorkerTimeout) as exc:
            self.broken(exc, raised=True)
            raise  # keeps its __cause__
        finally:
            self.sending = False
        if timeout is not None and not self.in_flight:  # the ranks start it now
            call.deadline = time.monotonic() + timeout
        call.stream = stream
        self.in_flight.append(call)
        self.by_seq[call.seq] = call
        if turn is not None:
            self.turns.remove(turn)
        if self.observers:
            call.record = CallRecord(call.seq, call.method, stream, call.started, call.sent)
            self.observers = tell(self.observers, "sent", call.record)
        if future is None:
            call.watchers = 1
        else:
            call.future = future
            future.set_running_or_notify_cancel()  # sent: it cannot be taken back
            self.want_collector()
        self.snapshot_if_due(call)
        if self.turns:
            self.changed_all()
        return call

    def snapshot_if_due(self, call: Call) -> None:
        """Under the lock, ``call`` just sent: with sessions, a SNAPSHOT right behind it
        when it is due (every snapshot_every calls, after every reset())."""
        if self.session is not None and self.session.due(call):
            self.send_snapshot(call.timeout)

    def send_snapshot(self, timeout: float | None) -> Call | None:
        """Under the lock: a SNAPSHOT in flight (None: the runner broke sending it)."""
        assert self.session is not None and self.path is not None
        try:
            snapshot = self.session.send_snapshot(self.path, timeout, bool(self.in_flight))
        except (WorkerCrashed, WorkerTimeout) as exc:
            self.broken(exc)  # the calls before it fail with it; this caller's too
            return None
        if timeout is not None and not self.in_flight:
            snapshot.deadline = time.monotonic() + timeout
        self.in_flight.append(snapshot)
        self.by_seq[snapshot.seq] = snapshot
        self.want_collector()
        return snapshot

    def first_snapshot(self, timeout: float | None) -> None:
        """start(), with sessions: the state load() left, before any call."""
        assert self.session is not None
        with self.lock:
            snapshot = self.send_snapshot(timeout)
            if snapshot is not None:
                self.pump(lambda: snapshot.done or self.state is not HEALTHY)
            self.check_usable()
            if self.session.snapshot is None:
                raise RuntimeError(f"snapshot_every={self.session.every}: snapshot() did not "
                                   f"return on every rank at start() "
                                   f"({self.session.failure}); fix snapshot(), or pass "
                                   f"snapshot_every=0")
        self.settle_futures()

    # -- what the waits of threads and tasks ask ------------------------------------------
    def answered_so_far(self) -> Callable[[], bool]:
        """Under the lock: what says that every call sent so far is answered, or that the
        runner broke or was shut down (a restart in progress is waited for)."""
        last = self.in_flight[-1] if self.in_flight else None
        return lambda: self.state is not RESTARTING and (
            self.state is not HEALTHY or last is None or last.done)

    def busy(self) -> list[int]:
        """The ranks that have not answered the call they run."""
        if not self.in_flight:
            return []
        head = self.in_flight[0]
        return [r for r in range(self.world_size) if r not in head.replies]

    def wait_while_sending(self, done: Callable[[], bool], deadline: float | None) -> None:
        """A RECLAIM round in the middle of a send: receive until ``done()`` or the deadline;
        the failure if the runner breaks meanwhile (a rank died)."""
        self.pump(lambda: done() or self.state is not HEALTHY, deadline)
        if self.state is not HEALTHY and self.failure is not None:
            raise self.failure

    # -- leaving ---------------------------------------------------------------------------
    def unwatch(self, call: Call) -> None:
        """A caller stops waiting for ``call`` (it may come back)."""
        call.watchers -= 1
        if call.watchers <= 0 and not call.done:
            self.want_collector()

    def leave(self, call: Call) -> None:
        """Nobody takes ``call``'s value or items any more: the ranks still finish it,
        and what it brings goes back unread."""
        call.left = True
        call.items.clear()
        call.watchers = 0
        if not call.done:
            self.want_collector()

    def leave_soon(self, call: Call) -> None:
        """:meth:`leave` from anywhere, a finalizer too: now if the lock is free, else by
        whoever holds it, at its next receive (a finalizer may run inside a locked
        section of this very thread)."""
        if self.lock.acquire(blocking=False):
            try:
                self.leave(call)
            finally:
                self.lock.release()
        else:
            self.leaving.append(call)

    def take_leaving(self) -> None:
        while self.leaving:
            self.leave(self.leaving.popleft())

    # -- receiving (threads) ---------------------------------------------------------------
    def pump(self, satisfied: Callable[[], bool], give_up: float | None = None) -> bool:
        """Under the lock: receive (or let the receiver receive; during a restart, let it
        work) until ``satisfied()`` (True) or the monotonic ``give_up`` passed (False)."""
        while not satisfied():
            now = time.monotonic()
            if give_up is not None and now >= give_up:
                return False
            if self.receiving or self.state is not HEALTHY:
                self.wait(WAKE if give_up is None else min(give_up - now, WAKE))
            else:
                self.serve(now, give_up)
        return True

    def serve(self, now: float, give_up: float | None) -> None:
        """As the receiver: one message (waiting until the next deadline or ``give_up``);
        a passed deadline with nothing left to read breaks the runner."""
        if self.leaving:
            self.take_leaving()
        path = self.path
        assert path is not None
        if path.answered_due:
            path.tell_answered()
        due = self.next_deadline()
        if due is not None and now >= due:
            if not self.drain():
                self.expire()
            return
        until = due if give_up is None else give_up if due is None else min(due, give_up)
        wait_ms = WAKE_MS if until is None or until - now >= WAKE else \
            timeouts.wait_ms(until - now)
        self.receiving = True
        message = None
        try:
            memory = path.memory
            if memory.hungry is not None or path.results.has_released():
                memory.flush()
            self.lock.release()
            try:
                if self.settled:
                    self.settle_futures()
                message = path.bus.receive(wait_ms)
            finally:
                self.lock.acquire()
            if message is not None:
                path.arrived(message[0])
                self.dispatch(message)
        finally:
            self.receiving = False
            if self.waiting or self.wakers or self.collector is not None:
                self.changed_all()

    def drain(self) -> bool:
        """Without waiting: dispatch what has arrived (True if anything did)."""
        path = self.path
        assert path is not None and not self.receiving
        if self.leaving:
            self.take_leaving()
        if path.answered_due:  # tasks receive only here: the retry must not wait for a thread
            path.tell_answered()
        path.memory.flush()
        got = False
        bus = path.bus
        for _ in range(DRAIN_MOST):
            if not bus.pull_events() & POLLIN:
                break
            message = bus.receive(0)
            if message is not None:
                got = True
                path.arrived(message[0])
                self.dispatch(message)
        if got:
            self.changed_all()
        return got

    def changed_all(self) -> None:
        """Under the lock: every waiter looks again (threads, tasks, the collector)."""
        if self.waiting:
            self.changed.notify_all()
        for waker in self.wakers:
            waker.wake()
        if self.collector is not None and self.unwatched():
            self.wanted.notify()

    def wait_for_receiver(self) -> None:
        """Under the lock: until no caller receives or sends (shutdown, a restart)."""
        give_up = time.monotonic() + 4 * WAKE
        while (self.receiving or self.sending) and time.monotonic() < give_up:
            self.wait(WAKE)

    def wait(self, seconds: float) -> None:
        """Under the lock: until changed_all() or ``seconds``."""
        self.waiting += 1
        try:
            self.changed.wait(seconds)
        finally:
            self.waiting -= 1

    # -- deadlines -------------------------------------------------------------------------
    def next_deadline(self) -> float | None:
        """The moment the call the ranks run runs out of time waiting for its next reply
        or item (None: it cannot).  A call behind it has no clock yet: its own starts
        when the ranks start it, and until then the call they run is the one that can be
        late (and the one a timeout names)."""
        return self.in_flight[0].deadline if self.in_flight else None

    def expire(self) -> None:
        """Nothing more arrived and the deadline of the call the ranks run passed: it
        timed out; the runner breaks."""
        assert self.in_flight
        head = self.in_flight[0]
        silent = [r for r in range(self.world_size) if r not in head.replies]
        self.broken(self.supervisor.timed_out(silent, head.timeout, head.what, head.replies,
                                              head.seq, head.method), head)

    # -- what arrives ----------------------------------------------------------------------
    def dispatch(self, message: tuple[dict, list]) -> None:
        """One message from a rank, its ledger fields already applied (CallPath.arrived)."""
        header, body = message
        kind = header[Field.KIND]
        path = self.path
        assert path is not None
        if kind == Kind.REPLY or kind == Kind.ITEM:
            call = self.by_seq.get(header[Field.SEQ])
            if call is None:  # a failed call's, or not ours
                path.discard(header)
            elif kind == Kind.ITEM:
                if header[Field.RANK] == 0:
                    if not call.itemized:
                        call.itemized = True
                        if self.observers and call.record is not None:
                            self.observers = tell(self.observers, "first_item", call.record,
                                                  perf_counter())
                    path.take_item(call, header, body)
                    if call.deadline is not None and call.timeout is not None:
                        call.deadline = time.monotonic() + call.timeout
            elif header[Field.RANK] not in call.replies:
                call.replies[header[Field.RANK]] = message
                if Field.LOGGED in header:  # its records reach the logs before its result
                    call.logged = True
                in_flight = self.in_flight
                while in_flight and len(in_flight[0].replies) == self.world_size:
                    self.answered(in_flight.popleft())
        elif kind == Kind.DEATH:
            dead = self.supervisor.dead_of(header)
            if dead is None or self.dying:  # stale, or the first notice judges them all
                return
            self.dying = True
            try:
                begun = self.last_replies(dead)
            finally:
                self.dying = False
            if self.state is not HEALTHY:  # a last reply broke it
                return
            # The call the dead ranks were running: the first they had not answered and
            # had begun, by their rings (a reply lost with its rank fails its call too).
            owed = [c for c in self.in_flight if not all(r in c.replies for r in dead)]
            at = next((c for c in owed if c.seq >= begun), owed[0] if owed else None)
            if at is None:
                self.broken(self.supervisor.crashed(dead, "an idle moment between calls",
                                                    logged=False))
            else:
                self.broken(self.supervisor.crashed(dead, at.what, at.seq, at.method,
                                                    logged=False), at)

    def last_replies(self, dead: list[int]) -> int:
        """A rank that died may have answered calls sent before the one it died in (calls
        in flight), its replies still on their way behind the death's notice: dispatch
        them first, for at most LAST_REPLIES seconds, so that the death fails the call it
        died in and a snapshot it finished counts.  Its ring tells which calls it ended;
        without one, a short look while it owes more than one.  The earliest seq the dead
        ranks began, by their rings (0: not known)."""
        begun = {r: self.supervisor.begun(r) for r in dead}

        def owed_before() -> bool:
            for rank, seq in begun.items():
                owed = [c.seq for c in self.in_flight if rank not in c.replies]
                if (owed and seq is not None and owed[0] < seq) or \
                        (seq is None and len(owed) > 1):
                    return True
            return False

        path = self.path
        assert path is not None
        known = [seq for seq in begun.values() if seq is not None]
        give_up = time.monotonic() + (LAST_REPLIES if len(known) == len(begun) else
                                      LAST_REPLIES_UNKNOWN)
        while self.state is HEALTHY and owed_before():
            now = time.monotonic()
            if now >= give_up:
                break
            message = path.bus.receive(timeouts.wait_ms(give_up - now))
            if message is not None:
                path.arrived(message[0])
                self.dispatch(message)
        return min(known, default=0)

    def answered(self, call: Call) -> None:
        """Every rank answered ``call``: judge it; the next call starts its clock."""
        del self.by_seq[call.seq]
        if self.in_flight:
            head = self.in_flight[0]
            if head.timeout is not None:
                head.deadline = time.monotonic() + head.timeout
        assert self.path is not None
        if call.method == Method.SNAPSHOT:  # the caller's own: no verdict, no observer
            self.path.owe_answered(call)
            assert self.session is not None
            self.session.record(call, self.path)
            call.settle(None, None)
            self.changed_all()
            return
        answered = perf_counter()
        if call.logged:  # the call's log records before its result or error
            self.supervisor.take_output()
        verdict = judge(call.method, self.path.outcomes(call),
                        lambda: self.path.collectives(call))
        if (self.timings.enabled or self.observers) and not call.left:
            times = (call.started, call.sent, answered, perf_counter())
            compute = compute_seconds(call, self.world_size)
            waits = collective_wait_seconds(call, self.world_size)
            if self.timings.enabled:
                self.timings.record(*times, compute, waits)
            if call.record is not None:
                call.measured = times, compute, waits
        if verdict.breaks:
            self.in_flight.appendleft(call)  # fails first, with the error itself
            self.broken(verdict.error, call)  # type: ignore[arg-type]
        else:
            self.path.owe_answered(call)
            if self.session is not None:
                self.session.record(call, self.path)
            self._settle(call, verdict.value, verdict.error,
                         OK if verdict.error is None else RAISED)
        self.changed_all()

    def _settle(self, call: Call, value: Any, error: BaseException | None,
                outcome: str) -> None:
        if call.left:
            value, outcome = None, CANCELLED  # nobody takes it: its memory goes back
        if call.command is not None and self.session is not None:  # failed: not kept
            assert self.path is not None
            self.session.release(call.command, self.path)
            call.command = None
        call.settle(value, error)
        if self.observers and call.record is not None:
            self.observers = tell(self.observers, "settled", call.record,
                                  CallEnd(outcome, error, *(call.measured or ())))
        if call.future is not None:
            self.settled.append(call)

    def settle_futures(self) -> None:
        """Outside the lock: futures' callbacks may call the runner."""
        settled = self.settled
        while settled:
            try:
                call = settled.popleft()
            except IndexError:
                return
            future, call.future = call.future, None
            if future is None:
                continue
            if call.error is not None:
                future.set_exception(call.error)
            else:
                future.set_result(call.value)

    # -- the collector ---------------------------------------------------------------------
    def unwatched(self) -> bool:
        return any(call.watchers <= 0 for call in self.in_flight)

    def want_collector(self) -> None:
        """Under the lock: a call in flight has no caller watching it."""
        if self.collector is None:
            self.collector = threading.Thread(target=self.collect, daemon=True,
                                              name="reactor-dist-collector")
            self.collector.start()
        else:
            self.wanted.notify()

    def collect(self) -> None:
        try:
            while True:
                with self.lock:
                    if self.state is not HEALTHY:
                        return
                    if self.receiving or not self.unwatched():
                        if not self.settled:
                            self.wanted.wait(WAKE)
                    else:
                        self.serve(time.monotonic(), None)
                self.settle_futures()
        finally:
            self.settle_futures()

    def stop_collector(self) -> None:
        """Outside the lock, once the queue is not healthy: the collector ends."""
        collector = self.collector
        if collector is not None and collector is not threading.current_thread():
            with self.lock:
                self.wanted.notify_all()
            collector.join(timeout=4 * WAKE)
            if not collector.is_alive():
                self.collector = None  # a new one starts at the next need (after a restart)

    # -- receiving (asyncio tasks) ---------------------------------------------------------
    def poll(self, satisfied: Callable[[], bool],
             give_up: float | None = None) -> bool | float | None:
        """Under the lock, never blocking (a task's turn): True once ``satisfied()``, False
        past ``give_up``; else when to look again (None: when woken)."""
        if satisfied():
            return True
        now = time.monotonic()
        if give_up is not None and now >= give_up:
            return False
        due = self.next_deadline()
        if not self.receiving and self.state is HEALTHY:
            if not self.drain() and due is not None and now >= due:
                self.expire()
            if satisfied():
                return True
            due = self.next_deadline()
        return due if give_up is None else give_up if due is None else min(due, give_up)

    def add_waker(self, waker: Waker) -> None:
        """Under the lock: a task waits; its loop watches the reply socket meanwhile."""
        self.wakers.append(waker)
        loop = waker.loop
        if not self.readers.get(loop):
            assert self.path is not None
            loop.add_reader(self.path.bus.pull_fd, self.readable, loop)
        self.readers[loop] = self.readers.get(loop, 0) + 1

    def remove_waker(self, waker: Waker) -> None:
        self.wakers.remove(waker)
        loop = waker.loop
        self.readers[loop] -= 1
        if not self.readers[loop]:
            del self.readers[loop]
            if self.path is not None and not loop.is_closed():
                with contextlib.suppress(Exception):  # the bus may be closed by now
                    loop.remove_reader(self.path.bus.pull_fd)

    def readable(self, loop: asyncio.AbstractEventLoop) -> None:
        """In ``loop``: the reply socket may have a message; its tasks look."""
        for waker in list(self.wakers):
            if waker.loop is loop:
                waker.set()
