"""The call queue: the one owner of the order of calls, their turns and the broken state.

Every form of call (``generate``, ``submit``, ``stream``, ``reset`` and their asyncio
forms) is a thin layer over :class:`CallQueue`.  Two calls in flight::

    callers (threads, tasks)       CallQueue (one lock)                ranks
    submit(a) -- turn 1 ------->   CallPath.send: CALL 7 ----------->  run 7
    submit(b) -- turn 2 ------->   CallPath.send: CALL 8 ----------->  (8 waits behind 7)
    submit(c) -- turn 3: waits     in flight [7, 8] = max_in_flight
    whoever waits receives   <--   dispatch by seq: REPLY 7 (rank 0)   <-- REPLY 7
      (one receiver at a time;     REPLY 7 (rank 1): 7 answered:       <-- REPLY 7
      the collector thread when      judged, its future settled;
      nobody else will)              8 starts its clock; turn 3 sends
                                   CALL 9 ------------------------->

The ranks run calls strictly in the order sent.  A call's ``timeout`` bounds, from
when the ranks start it, its wait for each reply or item; a rank that raised in a call
starts the next one only once every rank answered it (Kind.ANSWERED), so that no
collective of one call pairs with another's.  A crash, a timeout or a desync breaks
the runner: that call and every call behind it fail with that type of error
(``broken``, the one explicit unusable state); a call whose every rank raised the
same type fails alone.  A call
nobody waits for any more (Ctrl-C, a cancelled task, a stream left early) stays in
flight until the ranks answer it; its answer is discarded.

The lock guards everything here and both ledgers; only the blocking receive itself
runs outside it (:mod:`reactor_dist.receiving`: who receives, how the others wait,
when a call is late).  Futures are settled outside it, so that their callbacks may
call the runner.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from concurrent.futures import Future
from time import perf_counter
from typing import Any

from .calls import Call, CallPath, collective_wait_seconds, compute_seconds
from .errors import CallQueueFull, WorkerCrashed, WorkerTimeout, failed_behind, queue_full
from .observers import CANCELLED, CRASHED, DESYNC, OK, RAISED, TIMED_OUT, Observer, tell
from .outcome import judge
from .protocol import Field, Kind, Status
from .receiving import Receiver
from .restarts import RESTARTING, Restarts
from .supervisor import Supervisor
from .timings import Recorder

NEW, HEALTHY, UNUSABLE, CLOSED = "new", "healthy", "unusable", "closed"


class CallQueue:
    """Calls in send order, at most ``max_in_flight`` of them sent and not answered."""

    NEW, HEALTHY, UNUSABLE, CLOSED = NEW, HEALTHY, UNUSABLE, CLOSED  # for restarts.py

    def __init__(self, supervisor: Supervisor, max_in_flight: int, timings: Recorder) -> None:
        self.receiver = Receiver(self)
        self.lock = self.receiver.lock
        self.supervisor, self.max_in_flight, self.timings = supervisor, max_in_flight, timings
        self.world_size = supervisor.world_size
        self.path: CallPath | None = None
        self.state = NEW
        self.failure: BaseException | None = None
        self.in_flight: collections.deque[Call] = collections.deque()
        self.by_seq: dict[int, Call] = {}
        self.turns: collections.deque[object] = collections.deque()  # callers waiting to send
        self.settled: collections.deque[Call] = collections.deque()  # futures to settle
        self.left: collections.deque[Call] = collections.deque()  # leave_soon()'s
        self.answered_due = 0  # a Kind.ANSWERED not yet sent (a rank's pipe was full)
        self.restarts: Restarts | None = None  # set by the runner once built
        self.observers: tuple[Observer, ...] = ()  # metrics, traces (observers.py)

    # -- state ------------------------------------------------------------------------------
    def open(self) -> None:
        """start() succeeded: calls may go."""
        with self.lock:
            self.path = CallPath(self.supervisor, self.wait_while_sending, self.busy)
            self.supervisor.start_releaser(self.path.memory.pass_on_releases,
                                          lambda: self.path.last_sent)  # type: ignore[union-attr]
            self.state = HEALTHY

    def check_usable(self) -> None:
        state = self.state
        if state == HEALTHY:
            return
        if state == NEW:
            raise RuntimeError("start() has not run: call runner.start() (or use `with runner:`)")
        failure = self.failure
        if state == RESTARTING:
            raise RuntimeError(f"this DistributedRunner is restarting after "
                               f"{type(failure).__name__}: wait for it (a call waits by "
                               f"itself)") from failure
        if failure is None:
            raise RuntimeError("this DistributedRunner is unusable (it was shut down); build "
                               "and start a new one")
        budget = self.restarts.budget_note() if self.restarts is not None else ""
        then = "It was shut down; build and start a new one" if state == CLOSED else \
            "runner.restart() brings its ranks back (or shut it down and build a new one)"
        raise RuntimeError(f"this DistributedRunner is unusable: {type(failure).__name__}: "
                           f"{failure}{budget}. {then}") from failure

    def broken(self, exc: BaseException, at: Call | None = None) -> None:
        """The runner is unusable from now on: ``at`` (default: the call the ranks run)
        fails with ``exc``, every other call in flight with the same type of error."""
        if self.state != HEALTHY:
            return
        self.state, self.failure = UNUSABLE, exc
        note = self.restarts.after_failure(exc) if self.restarts is not None else None
        if note is not None:
            self.state = RESTARTING
        at = at or (self.in_flight[0] if self.in_flight else None)
        if isinstance(exc, WorkerCrashed) and self.observers:
            self.observers = tell(self.observers, "died", self.supervisor.dead())
        self.fail_in_flight(lambda call: exc if call is at else failed_behind(
            exc, call.what, at.what if at is not None else None), note,
            CRASHED if isinstance(exc, WorkerCrashed) else
            TIMED_OUT if isinstance(exc, WorkerTimeout) else DESYNC)
        if note is not None and note not in getattr(exc, "__notes__", ()):
            exc.add_note(note)  # raised by a call not yet in flight (a death while idle)

    def fail_in_flight(self, error_of: Callable[[Call], BaseException],
                       note: str | None = None, outcome: str = CANCELLED) -> None:
        for call in self.in_flight:
            if not call.done:
                error = error_of(call)
                if note is not None:
                    error.add_note(note)
                self._settle(call, None, error, outcome)
        self.in_flight.clear()
        self.by_seq.clear()
        self.turns.clear()
        self.receiver.changed_all()

    def close(self) -> None:
        """Shut down: the calls in flight fail; waits until nobody is receiving."""
        if self.restarts is not None:
            self.restarts.stop()
        with self.lock:
            if self.state == CLOSED:
                return
            if self.state == HEALTHY and self.in_flight and self.path is not None:
                # The ranks skip the calls that fail here, rather than run them first
                # (Supervisor.close sends the DROP, like SHUTDOWN, within the grace).
                self.supervisor.drop_through = self.path.seq
            self.state = CLOSED
            self.fail_in_flight(lambda call: RuntimeError(
                f"{call.what} was still in flight when the runner was shut down: it has no "
                f"result"))
            self.receiver.wait_for_receiver()
        self.receiver.stop_collector()
        self.settle_futures()

    # -- sending ----------------------------------------------------------------------------
    def send(self, method: str, value: Any, timeout: float | None,
             future: Future | None = None) -> Call:
        """Take a turn (first come, first served), wait for room in flight at most
        ``timeout`` (CallQueueFull), publish.  A ``future`` call has no waiter: the
        collector receives for it."""
        try:
            with self.lock:
                return self.send_locked(method, value, timeout, future)
        finally:
            self.settle_futures()  # a failure to send may have failed the calls in flight

    def send_locked(self, method: str, value: Any, timeout: float | None,
                    future: Future | None = None) -> Call:
        if self.state == RESTARTING:
            self.restarts.wait(method, timeout)  # type: ignore[union-attr]
        if not self.turns and self.state == HEALTHY and len(self.in_flight) < self.max_in_flight:
            return self.publish(None, method, value, timeout, future)  # nobody waits: at once
        self.check_usable()
        turn = object()
        self.turns.append(turn)
        try:
            if not self.my_turn(turn):
                give_up = None if timeout is None else time.monotonic() + timeout
                if not self.receiver.pump(lambda: self.my_turn(turn), give_up):
                    raise self.queue_full(method, timeout)
            return self.publish(turn, method, value, timeout, future)
        finally:
            self.leave_turn(turn)

    def my_turn(self, turn: object) -> bool:
        """This caller may send now (or must look why not: the runner broke)."""
        return self.state != HEALTHY or (
            self.turns[0] is turn and len(self.in_flight) < self.max_in_flight)

    def leave_turn(self, turn: object) -> None:
        if turn in self.turns:
            first = self.turns[0] is turn
            self.turns.remove(turn)
            if first and self.turns:
                self.receiver.changed_all()

    def publish(self, turn: object | None, method: str, value: Any, timeout: float | None,
                future: Future | None) -> Call:
        """Send now (our turn, room in flight); the call is in flight when this returns."""
        self.check_usable()
        assert self.path is not None
        self.receiver.sending = True
        try:
            call = self.path.send(method, value, timeout, bool(self.in_flight))
        except (WorkerCrashed, WorkerTimeout) as exc:
            self.broken(exc)
            raise  # keeps its __cause__
        finally:
            self.receiver.sending = False
        if timeout is not None and not self.in_flight:  # the ranks start it now
            call.deadline = time.monotonic() + timeout
        self.in_flight.append(call)
        self.by_seq[call.seq] = call
        if turn is not None:
            self.turns.remove(turn)
        if self.observers:
            self.observers = tell(self.observers, "sent", call)
        if future is None:
            call.watchers = 1
        else:
            call.future = future
            future.set_running_or_notify_cancel()  # sent: it cannot be taken back
            self.receiver.want_collector()
        if self.turns:
            self.receiver.changed_all()
        return call

    def queue_full(self, method: str, timeout: float | None) -> CallQueueFull:
        return queue_full(method, timeout, len(self.in_flight), self.max_in_flight,
                          self.in_flight[0].what if self.in_flight else "nothing")

    # -- what the waits of threads (blocking.py) and tasks (aio.py) ask -------------------
    def all_answered(self) -> Callable[[], bool] | None:
        """Under the lock, on a usable runner: None when no call is in flight, else
        what says that every call sent so far is answered (or the runner broke)."""
        self.check_usable()
        if not self.in_flight:
            return None
        last = self.in_flight[-1]
        return lambda: last.done or self.state != HEALTHY

    def busy(self) -> list[int]:
        """The ranks that have not answered the call they run."""
        if not self.in_flight:
            return []
        head = self.in_flight[0]
        return [r for r in range(self.world_size) if r not in head.replies]

    def wait_while_sending(self, done: Callable[[], bool], deadline: float | None) -> None:
        """A RECLAIM round in the middle of a send: receive until ``done()`` or the deadline;
        the failure if the runner breaks meanwhile (a rank died)."""
        self.receiver.pump(lambda: done() or self.state != HEALTHY, deadline)
        if self.state != HEALTHY and self.failure is not None:
            raise self.failure

    # -- leaving ----------------------------------------------------------------------------
    def unwatch(self, call: Call) -> None:
        """A caller stops waiting for ``call`` (it may come back)."""
        call.watchers -= 1
        if call.watchers <= 0 and not call.done:
            self.receiver.want_collector()

    def leave(self, call: Call) -> None:
        """Nobody takes ``call``'s value or items any more: the ranks still finish it,
        and what it brings goes back unread."""
        call.abandoned = True
        call.items.clear()
        call.watchers = 0
        if not call.done:
            self.receiver.want_collector()

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
            self.left.append(call)

    def take_left(self) -> None:
        while self.left:
            self.leave(self.left.popleft())

    # -- what arrives -----------------------------------------------------------------------
    def dispatch(self, message: tuple[dict, list]) -> None:
        """One message from a rank, its ledger fields already applied (CallPath.receive)."""
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
                        if self.observers:
                            self.observers = tell(self.observers, "first_item", call,
                                                  perf_counter())
                    path.take_item(call, header, body)
                    if call.deadline is not None and call.timeout is not None:
                        call.deadline = time.monotonic() + call.timeout
            elif header[Field.RANK] not in call.replies:
                call.replies[header[Field.RANK]] = message
                in_flight = self.in_flight
                while in_flight and len(in_flight[0].replies) == self.world_size:
                    self.answered(in_flight.popleft())
        elif kind == Kind.DEATH and header.get(Field.EPOCH, 0) == self.supervisor.epoch:
            dead = self.supervisor.dead() or [header[Field.RANK]]
            # The call the dead rank was running: the first it had not answered.
            at = next((c for c in self.in_flight if not all(r in c.replies for r in dead)),
                      None)
            what = at.what if at is not None else "an idle moment between calls"
            self.broken(self.supervisor.crashed(dead, what), at)

    def answered(self, call: Call) -> None:
        """Every rank answered ``call``: judge it; the next call starts its clock."""
        del self.by_seq[call.seq]
        if self.in_flight:
            head = self.in_flight[0]
            if head.timeout is not None:
                head.deadline = time.monotonic() + head.timeout
        assert self.path is not None
        answered = perf_counter()
        verdict = judge(call.method, self.path.outcomes(call))
        if (self.timings.enabled or self.observers) and not call.abandoned:
            times = (call.started, call.sent, answered, perf_counter())
            compute = compute_seconds(call, self.world_size)
            waits = call.collective_wait = collective_wait_seconds(call, self.world_size)
            if self.timings.enabled:
                self.timings.record(*times, compute, waits)
            call.times, call.compute = times, compute
        if verdict.breaks:
            self.in_flight.appendleft(call)  # fails first, with the error itself
            self.broken(verdict.error, call)  # type: ignore[arg-type]
        else:
            if any(header.get(Field.STATUS) == Status.RAISED
                   for header, _ in call.replies.values()):
                self.answered_due = call.seq  # the ranks that raised hold the next call
                self.tell_answered()
            self._settle(call, verdict.value, verdict.error,
                         OK if verdict.error is None else RAISED)
        self.receiver.changed_all()

    def tell_answered(self) -> None:
        """Under the lock: Kind.ANSWERED for ``answered_due``; a full pipe keeps it due,
        tried again at the next receive (a rank that is behind reads it in turn)."""
        assert self.path is not None
        if self.path.bus.try_publish({Field.KIND: Kind.ANSWERED, Field.SEQ: self.answered_due}):
            self.answered_due = 0

    def _settle(self, call: Call, value: Any, error: BaseException | None,
                outcome: str) -> None:
        if call.abandoned:
            value, outcome = None, CANCELLED  # nobody takes it: its memory goes back
        call.settle(value, error)
        if self.observers:
            self.observers = tell(self.observers, "settled", call, outcome, call.times,
                                  call.compute)
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
