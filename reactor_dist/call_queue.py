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

The ranks run calls strictly in the order sent.  A call's ``timeout`` bounds its wait
behind the call the ranks run, and then, from when the ranks start it, its wait for
each reply or item.  A crash, a timeout or a desync breaks the runner: that call and
every call behind it fail with that type of error (``broken``, the one explicit
unusable state); a call whose every rank raised the same type fails alone.  A call
nobody waits for any more (Ctrl-C, a cancelled task, a stream left early) stays in
flight until the ranks answer it; its answer is discarded.

The lock guards everything here and both ledgers; only the blocking receive itself
runs outside it (:mod:`reactor_dist.receiving`: who receives, how the others wait).
Futures are settled outside it, so
that their callbacks may call the runner.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from concurrent.futures import Future
from time import perf_counter
from typing import Any

from .calls import Call, CallPath, compute_seconds
from .errors import CallQueueFull, WorkerCrashed, WorkerTimeout, failed_behind
from .outcome import judge
from .protocol import Field, Kind
from .receiving import WAKE, Receiver
from .restarts import RESTARTING, Restarts
from .timings import Recorder
from .transport import Transport

NEW, READY, UNUSABLE, CLOSED = "new", "ready", "unusable", "closed"


class CallQueue:
    """Calls in send order, at most ``max_in_flight`` of them sent and not answered."""

    READY = READY

    def __init__(self, transport: Transport, max_in_flight: int, timings: Recorder) -> None:
        self.receiver = Receiver(self)
        self.lock = self.receiver.lock
        self.transport, self.max_in_flight, self.timings = transport, max_in_flight, timings
        self.world_size = transport.world_size
        self.path: CallPath | None = None
        self.state = NEW
        self.failure: BaseException | None = None
        self.in_flight: collections.deque[Call] = collections.deque()
        self.by_seq: dict[int, Call] = {}
        self.turns: collections.deque[object] = collections.deque()  # callers waiting to send
        self.settled: collections.deque[Call] = collections.deque()  # futures to settle
        self.left: collections.deque[Call] = collections.deque()  # leave_soon()'s
        self.restarts: Restarts | None = None  # set by the runner once built

    # -- state ------------------------------------------------------------------------------
    def open(self) -> None:
        """start() succeeded: calls may go."""
        with self.lock:
            self.path = CallPath(self.transport, self.wait_while_sending, self.busy)
            self.transport.start_releaser(self.path.memory.pass_on_releases,
                                          lambda: self.path.last_sent)  # type: ignore[union-attr]
            self.state = READY

    def check_usable(self) -> None:
        state = self.state
        if state == READY:
            return
        if state == NEW:
            raise RuntimeError("start() has not run: call runner.start() (or use `with runner:`)")
        failure = self.failure
        if state == RESTARTING:
            raise RuntimeError(f"this DistributedRunner is restarting after "
                               f"{type(failure).__name__}: wait for it (a call waits by "
                               f"itself)") from failure
        if state == CLOSED or failure is None:  # shut down, or start() failed: its error
            why = f": {type(failure).__name__}: {failure}" if failure is not None else ""
            raise RuntimeError(f"this DistributedRunner is unusable{why} (it was shut down); "
                               f"build and start a new one") from failure
        budget = self.restarts.budget_note() if self.restarts is not None else ""
        raise RuntimeError(
            f"this DistributedRunner is unusable: {type(failure).__name__}: {failure}{budget}. "
            f"runner.restart() brings its ranks back (or shut it down and build a new one)"
        ) from failure

    def broken(self, exc: BaseException, at: Call | None = None) -> None:
        """The runner is unusable from now on: ``at`` (default: the call the ranks run)
        fails with ``exc``, every other call in flight with the same type of error."""
        if self.state != READY:
            return
        self.state, self.failure = UNUSABLE, exc
        note = self.restarts.after_failure(exc) if self.restarts is not None else None
        if note is not None:
            self.state = RESTARTING
        at = at or (self.in_flight[0] if self.in_flight else None)
        self._fail_in_flight(lambda call: exc if call is at else failed_behind(
            exc, call.what, at.what if at is not None else None), note)
        if note is not None and note not in getattr(exc, "__notes__", ()):
            exc.add_note(note)  # raised by a call not yet in flight (a death while idle)

    def _fail_in_flight(self, error_of: Callable[[Call], BaseException],
                        note: str | None = None) -> None:
        for call in self.in_flight:
            if not call.done:
                error = error_of(call)
                if note is not None:
                    error.add_note(note)
                self._settle(call, None, error)
        self.in_flight.clear()
        self.by_seq.clear()
        self.turns.clear()
        self.receiver.changed_all()

    def begin_restart(self) -> None:
        """restart() from the caller: the calls in flight fail; new ones wait for it."""
        with self.lock:
            if self.state == CLOSED:
                raise RuntimeError("this DistributedRunner was shut down: restart() brings "
                                   "back a runner that broke, not one shut down; build a new one")
            if self.state == NEW:
                raise RuntimeError("start() has not run: call runner.start() first")
            while self.state == RESTARTING:  # a restart of its own (max_restarts) runs
                self.receiver.wait(WAKE)
            if self.state == READY:
                self.failure = None
                self._fail_in_flight(lambda call: RuntimeError(
                    f"{call.what} was in flight when runner.restart() was called: it has "
                    f"no result"))
            self.state = RESTARTING
            self.receiver.changed_all()

    def restarted(self, failure: BaseException | None) -> None:
        """The restart ended: ready again, or unusable with ``failure``."""
        with self.lock:
            if self.state != RESTARTING:
                return  # shut down meanwhile
            if failure is None:
                assert self.path is not None
                self.path.ranks = self.transport.ranks  # type: ignore[assignment]
                self.state, self.failure = READY, None
            else:
                self.state, self.failure = UNUSABLE, failure
            self.receiver.changed_all()

    def close(self) -> None:
        """Shut down: the calls in flight fail; waits until nobody is receiving."""
        if self.restarts is not None:
            self.restarts.stop()
        with self.lock:
            if self.state == CLOSED:
                return
            self.state = CLOSED
            self._fail_in_flight(lambda call: RuntimeError(
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
            self.wait_for_restart(method, timeout)
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

    def wait_for_restart(self, method: str, timeout: float | None) -> None:
        """Under the lock: a call made while the runner restarts waits for it."""
        give_up = None if timeout is None else time.monotonic() + timeout
        while self.state == RESTARTING:
            now = time.monotonic()
            if give_up is not None and now >= give_up:
                raise CallQueueFull(
                    f"{method}() waited {timeout:g} s for the runner's restart to end; "
                    f"nothing was sent (the restart goes on)")
            self.receiver.wait(WAKE if give_up is None else min(WAKE, give_up - now))

    def my_turn(self, turn: object) -> bool:
        """This caller may send now (or must look why not: the runner broke)."""
        return self.state != READY or (
            self.turns[0] is turn and len(self.in_flight) < self.max_in_flight)

    def leave_turn(self, turn: object) -> None:
        if turn in self.turns:
            first = self.turns[0] is turn
            self.turns.remove(turn)
            if first and self.turns:
                self.receiver.changed_all()

    def publish(self, turn: object, method: str, value: Any, timeout: float | None,
                future: Future | None) -> Call:
        """Send now (our turn, room in flight); the call is in flight when this returns."""
        self.check_usable()
        assert self.path is not None
        self.receiver.sending = True
        try:
            call = self.path.send(method, value, timeout)
        except (WorkerCrashed, WorkerTimeout) as exc:
            self.broken(exc)
            raise  # keeps its __cause__
        finally:
            self.receiver.sending = False
        now = time.monotonic()
        if timeout is not None:
            call.queued_until = now + timeout
            if not self.in_flight:
                call.deadline = call.queued_until
        self.in_flight.append(call)
        self.by_seq[call.seq] = call
        self.turns.remove(turn)
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
        running = self.in_flight[0].what if self.in_flight else "nothing"
        return CallQueueFull(
            f"{method}() waited {timeout:g} s for its turn: the call queue stayed full "
            f"({len(self.in_flight)} calls in flight, max_in_flight={self.max_in_flight}; the "
            f"ranks were running {running}). Nothing was sent and the runner stays healthy; "
            f"wait for a result first, or raise max_in_flight or the timeout")

    # -- waiting (threads; asyncio: reactor_dist.aio) ------------------------------------------
    def call(self, method: str, value: Any, timeout: float | None) -> Any:
        """Send and wait for the answer: rank 0's value, or the contract's error."""
        try:
            with self.lock:
                call = self.send_locked(method, value, timeout)
                try:
                    self.receiver.pump(lambda: call.done)
                except BaseException:  # interrupted (Ctrl-C): the ranks still run it
                    self.leave(call)
                    raise
        finally:
            self.settle_futures()
        return call.result()

    def submit(self, method: str, value: Any, timeout: float | None) -> Future:
        future: Future = Future()
        self.send(method, value, timeout, future)
        return future

    def next_item(self, call: Call) -> tuple[bool, Any]:
        """(True, item) for rank 0's next item of ``call``; (False, None) once every rank
        answered and no item is left (then ``call.result()`` is the end)."""
        with self.lock:
            call.watchers += 1
            try:
                self.receiver.pump(lambda: bool(call.items) or call.done)
            except BaseException:  # interrupted (Ctrl-C): the stream ends
                self.leave(call)
                raise
            finally:
                self.unwatch(call)
            if call.items:
                return True, call.items.popleft()
        self.settle_futures()
        return False, None

    def wait_idle(self, timeout: float | None) -> bool:
        """Until every call sent so far is answered by every rank (True), or ``timeout``
        passed (False); raises the failure if the runner breaks meanwhile."""
        with self.lock:
            self.check_usable()
            if not self.in_flight:
                return True
            last = self.in_flight[-1]
            give_up = None if timeout is None else time.monotonic() + timeout
            idle = self.receiver.pump(lambda: last.done or self.state != READY, give_up)
            if self.state != READY:
                self.check_usable()  # raises, chaining the failure
        self.settle_futures()
        return idle

    def busy(self) -> list[int]:
        """The ranks that have not answered the call they run."""
        if not self.in_flight:
            return []
        head = self.in_flight[0]
        return [r for r in range(self.world_size) if r not in head.replies]

    def wait_while_sending(self, done: Callable[[], bool], deadline: float | None) -> None:
        """A RECLAIM round in the middle of a send: receive until ``done()`` or the deadline;
        the failure if the runner breaks meanwhile (a rank died)."""
        self.receiver.pump(lambda: done() or self.state != READY, deadline)
        if self.state != READY and self.failure is not None:
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
                    path.take_item(call, header, body)
                    if call.deadline is not None and call.timeout is not None:
                        call.deadline = time.monotonic() + call.timeout
            elif header[Field.RANK] not in call.replies:
                call.replies[header[Field.RANK]] = message
                in_flight = self.in_flight
                while in_flight and len(in_flight[0].replies) == self.world_size:
                    self.answered(in_flight.popleft())
        elif kind == Kind.DEATH and header.get(Field.EPOCH, 0) == self.transport.epoch:
            dead = self.transport.dead() or [header[Field.RANK]]
            what = self.in_flight[0].what if self.in_flight else "an idle moment between calls"
            self.broken(self.transport.crashed(dead, what))

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
        if self.timings.enabled and not call.abandoned:
            self.timings.record(call.started, call.sent, answered, perf_counter(),
                                compute_seconds(call, self.world_size))
        if verdict.breaks:
            self.in_flight.appendleft(call)  # fails first, with the error itself
            self.broken(verdict.error, call)  # type: ignore[arg-type]
        else:
            self._settle(call, verdict.value, verdict.error)
        self.receiver.changed_all()

    def _settle(self, call: Call, value: Any, error: BaseException | None) -> None:
        if call.abandoned:
            value = None  # nobody takes it: its memory goes back
        call.settle(value, error)
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

    # -- deadlines --------------------------------------------------------------------------
    def next_deadline(self) -> float | None:
        """The nearest moment a call in flight runs out of time (None: none can)."""
        in_flight = self.in_flight
        if len(in_flight) == 1:
            return in_flight[0].deadline
        due = None
        for i, call in enumerate(in_flight):
            when = call.deadline if i == 0 else (None if call.abandoned else call.queued_until)
            if when is not None and (due is None or when < due):
                due = when
        return due

    def expire(self, now: float) -> None:
        """Nothing more arrived and a deadline passed: the call the ranks run, or a call
        waiting behind it, timed out; the runner breaks."""
        assert self.in_flight
        head = self.in_flight[0]
        silent = [r for r in range(self.world_size) if r not in head.replies]
        if head.deadline is not None and now >= head.deadline:
            self.broken(self.transport.timed_out(silent, head.timeout, head.what, head.replies),
                        head)
            return
        for call in list(self.in_flight)[1:]:
            if call.queued_until is not None and not call.abandoned and now >= call.queued_until:
                running = (head.seq, silent, head.abandoned)
                self.broken(self.transport.timed_out(
                    list(range(self.world_size)), call.timeout, call.what, {}, running), call)
                return

