"""The call queue: the one driver of the engine, for threads and asyncio tasks alike.

The engine (:mod:`reactor_dist.caller.engine`) decides; this module does the I/O it
decides on: it holds the lock, encodes and publishes calls, receives the replies and
feeds them to the engine, makes the errors of a crash or a timeout (which read the
ranks' stacks and rings), carries out what the engine asks (:meth:`CallQueue.carry_out`),
settles futures outside the lock, and runs the collector thread.  Every form of call
(``generate``, ``submit``, ``stream``, ``call``, ``reset`` and their asyncio forms) is a
thin adapter over it (:mod:`reactor_dist.caller.blocking`, :mod:`reactor_dist.caller.aio`,
:mod:`reactor_dist.caller.stream`).  Two calls in flight::

    callers (threads, tasks)       CallQueue (one lock) + Engine          ranks
    submit(a) -- at once ------>   CallPath.send: CALL 7 -------------->  run 7
    submit(b) -- at once ------>   CallPath.send: CALL 8 -------------->  (8 waits behind 7)
    submit(c) -- turn: waits       in flight [7, 8] = max_in_flight
    whoever waits receives   <--   engine.feed(REPLY 7, rank 0)         <-- REPLY 7
      (one receiver at a time;     engine.feed(REPLY 7, rank 1): 7 is   <-- REPLY 7
      the collector thread when      answered, judged, settled; 8 starts
      nobody else will)              its clock; turn 3 sends
                                   CALL 9 ---------------------------->

While the runner restarts, every call form waits for the end (at most its
``queue_timeout``), a caller that was already waiting for its turn included.

One PULL socket carries the answers of every call in flight, so one caller at a time
receives (``receiving``) and feeds each message to the engine; the others wait on a
condition (threads) or a :class:`Waker` (tasks) that every change wakes.  A thread
blocks in ZeroMQ with the lock released; a task only takes what has arrived and then
awaits the socket's descriptor, so the loop never blocks.  When calls are in flight
that no caller is watching, the collector thread receives for them, so that futures
settle, crashes are reported and left answers go back at once.  Only a receiver that
found nothing more to read declares a deadline passed.

The lock guards the engine and both ledgers; only the blocking receive itself runs
outside it.  Futures are settled outside it, so that their callbacks may call the
runner.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from threading import get_ident
from time import monotonic
from typing import Any

import zmq

from .. import timeouts
from ..errors import WorkerCrashed, WorkerTimeout
from ..wire.protocol import Field, Kind
from .calls import Call, CallPath
from .engine import CLOSED, HEALTHY, RESTARTING, Do, Engine, RestartPolicy
from .observers import Observer, tell
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
REPLY, ITEM, DEATH = Kind.REPLY, Kind.ITEM, Kind.DEATH

log = logging.getLogger("reactor_dist")


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


class CallQueue:
    """The engine's driver: ``session`` (snapshot_every=) and ``retry_failed`` are given
    to the engine when it is made, and so is its restart budget: ``restarts(queue)``
    makes it (the restarts drive this queue)."""

    def __init__(self, supervisor: Supervisor, max_in_flight: int, timings: Recorder, *,
                 session: Session | None = None, retry_failed: bool = False,
                 restarts: Callable[[CallQueue], RestartPolicy] | None = None) -> None:
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)  # something arrived, a turn moved
        self.wanted = threading.Condition(self.lock)  # a call has nobody waiting for it
        self.supervisor, self.timings = supervisor, timings
        self.world_size = supervisor.world_size
        self.restarts = restarts(self) if restarts is not None else None
        self.session = session  # the engine's too: it keeps what each call leaves
        self.engine = Engine(supervisor.world_size, max_in_flight, timings, session=session,
                             retry_failed=retry_failed, restarts=self.restarts)
        self.path: CallPath | None = None
        self.leaving: collections.deque[Call] = collections.deque()  # leave_soon()'s
        self.receiving = False  # a caller owns the reply socket now
        self.dying = False  # a death's notice waits for the dead ranks' last replies
        self.sending = False  # a caller is between encode and publish
        self.waiting = 0  # threads in changed.wait() (none: no notify to pay for)
        self.wakers: list[Waker] = []
        self.readers: dict[asyncio.AbstractEventLoop, int] = {}  # tasks waiting, per loop
        self.collector: threading.Thread | None = None
        self.collector_ident = 0  # its thread's (0: none runs), which needs no waking

    # -- observers -------------------------------------------------------------------------
    def attach(self, observer: Observer) -> None:
        """``observer`` hears of every call from now on (metrics, traces)."""
        with self.lock:
            if observer not in self.engine.observers:
                self.engine.observers = (*self.engine.observers, observer)

    def detach(self, observer: Observer) -> None:
        with self.lock:
            self.engine.observers = tuple(o for o in self.engine.observers
                                          if o is not observer)

    def tell_observers(self, hook: str, *args: Any) -> None:
        """Outside the lock: every observer's ``hook`` (one that raises is dropped)."""
        if self.engine.observers:
            observers = tell(self.engine.observers, hook, *args)
            with self.lock:
                self.engine.observers = observers

    # -- what the engine asks --------------------------------------------------------------
    def carry_out(self) -> None:
        """Under the lock, after every step of the engine: what it asked for, in order,
        then every waiter looks again if anything changed."""
        engine = self.engine
        todo = engine.todo
        while todo:
            do, arg = todo.popleft()
            if do is Do.TELL_ANSWERED:
                assert self.path is not None
                self.path.owe_answered(arg)
            elif do is Do.WANT_COLLECTOR:
                self.want_collector()
            elif do is Do.TAKE_OUTPUT:
                self.supervisor.take_output()
            elif do is Do.LOG:
                log.log(arg[0], "%s", arg[1])
            elif do is Do.START_RESTART:
                assert self.restarts is not None
                self.restarts.start()
        session = self.session
        if session is not None and session.unlinking:
            session.unlink_let_go()
        if engine.changed:
            engine.changed = False
            self.changed_all()

    def broken(self, exc: BaseException, at: Call | None = None,
               raised: bool = False) -> None:
        """Under the lock: :meth:`Engine.broken`, carried out."""
        self.engine.broken(exc, at, raised)
        self.carry_out()

    # -- states ----------------------------------------------------------------------------
    def open(self) -> None:
        """start() succeeded: calls may go."""
        with self.lock:
            self.path = path = CallPath(self.supervisor, self.wait_while_sending,
                                        self.engine.busy)
            self.supervisor.start_releaser(path.memory.pass_on_releases,
                                           lambda: path.last_sent)
            self.engine.open(path)
            self.carry_out()

    def start_failed(self, exc: BaseException) -> None:
        with self.lock:
            self.engine.move(CLOSED, exc)
            self.carry_out()

    def begin_restart(self) -> None:
        """restart() from the caller: the calls in flight fail; new ones wait for it (a
        restart of its own, with max_restarts, is waited for first)."""
        with self.lock:
            while not self.engine.begin_restart():
                self.wait(WAKE)
            self.carry_out()
        self.settle_futures()

    def take_over_for_restart(self) -> tuple[int, BaseException | None]:
        """A restart begins its work: nobody receives any more (the restart's exchanges
        read the socket); the last call sent, and why the runner restarts."""
        with self.lock:
            self.wait_for_receiver()
            assert self.path is not None
            seq, why = self.path.seq, self.engine.failure
        self.stop_collector()
        return seq, why

    def restart_ended(self, failure: BaseException | None) -> bool:
        """The restart ended: healthy again, or unusable with ``failure``; False if it
        had ended already (shut down meanwhile, or this very call moved it)."""
        with self.lock:
            engine = self.engine
            if engine.state is not RESTARTING:
                return False
            if failure is None:
                assert self.path is not None and self.supervisor.ranks is not None
                self.path.ranks = self.supervisor.ranks
            self.send_retries(engine.restart_ended(failure))
            self.carry_out()
        self.settle_futures()  # the calls that failed here: no collector runs for them now
        return True

    def send_retries(self, retrying: list[tuple[Call, BaseException]]) -> None:
        """Under the lock, healthy again after an automatic restart: the calls the fault
        failed go again, in their order and before any other (retry_failed)."""
        path, engine = self.path, self.engine
        assert path is not None
        for index, (call, _) in enumerate(retrying):
            try:
                assert call.command is not None
                seq = path.send_again(call.command, bool(engine.in_flight))
            except (WorkerCrashed, WorkerTimeout) as exc:
                engine.retrying = retrying[index:]
                engine.broken(exc, raised=True)  # a retried call is not sent again: they fail
                engine.fail_retries(str)
                return
            if engine.resent(call, seq, time.monotonic()):
                self.send_snapshot(call.timeout)

    def close(self) -> None:
        """Shut down: the calls in flight fail; waits until nobody is receiving."""
        with self.lock:
            engine = self.engine
            if engine.state is CLOSED:
                return
            if engine.state is HEALTHY and engine.in_flight and self.path is not None:
                # The ranks skip the calls that fail here, rather than run them first
                # (Supervisor.close sends the DROP, like SHUTDOWN, within the grace).
                self.supervisor.drop_through = self.path.seq
            engine.close()
            self.carry_out()
            self.wait_for_receiver()
            if self.session is not None:
                self.session.close()
        self.stop_collector()
        self.drop_readers()
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
            if self.engine.free_to_send():  # at once: no turn to wait for
                return self.send_now(None, method, value, timeout, future, stream)
            return self.send_once(method, value, timeout, queue_timeout, future, stream)
        except (WorkerCrashed, WorkerTimeout):
            # The fault was found as this call went (a death while idle): with
            # retry_failed it goes after the automatic restart, like the calls in flight.
            if not (self.engine.retry_failed and self.engine.state is RESTARTING):
                raise
        return self.send_once(method, value, timeout, queue_timeout, future, stream)

    def send_once(self, method: str, value: Any, timeout: float | None,
                  queue_timeout: float | None, future: Future | None = None,
                  stream: bool = False) -> Call:
        engine = self.engine
        if engine.free_to_send():
            return self.send_now(None, method, value, timeout, future, stream)  # at once
        turn = engine.take_turn()
        try:
            give_up = None if queue_timeout is None else time.monotonic() + queue_timeout
            if not self.pump(lambda: engine.may_send(turn), give_up):
                raise engine.not_sent(method, queue_timeout)
            engine.check_usable()  # our turn came as the runner broke: why it cannot go
            return self.send_now(turn, method, value, timeout, future, stream)
        finally:
            engine.leave_turn(turn)
            self.carry_out()

    def send_now(self, turn: object | None, method: str, value: Any, timeout: float | None,
                 future: Future | None, stream: bool = False) -> Call:
        """Send now (our turn, room in flight, healthy); the call is in flight when this
        returns."""
        engine = self.engine
        path = self.path
        assert path is not None
        self.sending = True
        try:
            call = path.send(method, value, timeout, bool(engine.in_flight),
                             keep=self.session is not None)
        except (WorkerCrashed, WorkerTimeout) as exc:
            self.broken(exc, raised=True)
            raise  # keeps its __cause__
        finally:
            self.sending = False
        if engine.sent(call, turn, monotonic(), future, stream):
            self.send_snapshot(call.timeout)
        if engine.todo or engine.changed:
            self.carry_out()
        return call

    def send_snapshot(self, timeout: float | None) -> Call | None:
        """Under the lock (sessions): a SNAPSHOT in flight (None: the runner broke
        sending it)."""
        engine = self.engine
        assert self.session is not None and self.path is not None
        try:
            snapshot = self.session.send_snapshot(self.path, timeout, bool(engine.in_flight))
        except (WorkerCrashed, WorkerTimeout) as exc:
            self.broken(exc)  # the calls before it fail with it; this caller's too
            return None
        engine.snapshot_sent(snapshot, time.monotonic())
        self.carry_out()
        return snapshot

    def first_snapshot(self, timeout: float | None) -> None:
        """start(), with sessions: the state load() left, before any call."""
        engine = self.engine
        assert self.session is not None
        with self.lock:
            snapshot = self.send_snapshot(timeout)
            if snapshot is not None:
                self.pump(lambda: snapshot.done or engine.state is not HEALTHY)
            engine.check_usable()
            if self.session.snapshot is None:
                raise RuntimeError(f"snapshot_every={self.session.every}: snapshot() did "
                                   f"not return on every rank at start() "
                                   f"({self.session.failure}); fix snapshot(), or pass "
                                   f"snapshot_every=0")
        self.settle_futures()

    def wait_while_sending(self, done: Callable[[], bool], deadline: float | None) -> None:
        """A RECLAIM round in the middle of a send: receive until ``done()`` or the deadline;
        the failure if the runner breaks meanwhile (a rank died)."""
        engine = self.engine
        self.pump(lambda: done() or engine.state is not HEALTHY, deadline)
        if engine.state is not HEALTHY and engine.failure is not None:
            raise engine.failure

    # -- leaving ---------------------------------------------------------------------------
    def unwatch(self, call: Call) -> None:
        """Under the lock: a caller stops waiting for ``call`` (it may come back)."""
        self.engine.unwatch(call)
        self.carry_out()

    def leave(self, call: Call) -> None:
        """Under the lock: nobody takes ``call``'s value or items any more."""
        self.engine.leave(call)
        self.carry_out()

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
            self.engine.leave(self.leaving.popleft())
        self.carry_out()

    # -- receiving (threads) ---------------------------------------------------------------
    def pump(self, satisfied: Callable[[], bool], give_up: float | None = None) -> bool:
        """Under the lock: receive (or let the receiver receive; during a restart, let it
        work) until ``satisfied()`` (True) or the monotonic ``give_up`` passed (False)."""
        while not satisfied():
            now = time.monotonic()
            if give_up is not None and now >= give_up:
                return False
            if self.receiving or self.engine.state is not HEALTHY:
                self.wait(WAKE if give_up is None else min(give_up - now, WAKE))
            else:
                self.serve(now, give_up)
        return True

    def serve(self, now: float, give_up: float | None) -> None:
        """As the receiver: one message (waiting until the next deadline or ``give_up``),
        and whatever else has arrived by then; a passed deadline with nothing left to read
        breaks the runner."""
        path = self.path
        assert path is not None
        if self.leaving:
            self.take_leaving()
        if path.answered_due:
            path.tell_answered()
        engine = self.engine
        due = engine.in_flight[0].deadline if engine.in_flight else None
        if due is not None and now >= due:
            if not self.drain():
                self.expire()
            return
        until = due if give_up is None else give_up if due is None else min(due, give_up)
        wait_ms = WAKE_MS if until is None or until - now >= WAKE else \
            timeouts.wait_ms(until - now)
        self.receiving = True
        try:
            memory = path.memory
            if memory.hungry is not None or path.results.has_released():
                memory.flush()
            bus = path.bus
            # The call the ranks run: its acknowledgements are taken in one pass, with
            # the lock released once (what else arrives ends the pass).
            head = engine.in_flight[0] if engine.in_flight else None
            seq, owed = (head.seq, self.world_size - len(head.replies)) if head else (0, 1)
            self.lock.release()
            try:
                if engine.settled:
                    self.settle_futures()
                arrived = bus.gather(seq, owed, wait_ms, until)
            finally:
                self.lock.acquire()
            if arrived and len(arrived[0]) != 2:  # acknowledgements: counted in one go
                counted = engine.ack(arrived, monotonic())
                if engine.todo or engine.changed:
                    self.carry_out()
                del arrived[:counted]
            for message in arrived:
                self.dispatch(message)
        finally:
            self.receiving = False
            if self.waiting or self.wakers or (self.collector is not None and
                                               self.collector_ident != get_ident()):
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
            message = bus.receive(0, acks=True)
            if message is not None:
                got = True
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
        if self.collector is not None and self.collector_ident != get_ident() and \
                self.engine.unwatched():
            self.wanted.notify()  # (the collector itself looks again as it loops)

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

    def expire(self) -> None:
        """Nothing more arrived and the deadline of the call the ranks run passed: it
        timed out (its error names the silent ranks, with their stacks); the runner
        breaks."""
        head = self.engine.overdue(time.monotonic())
        if head is None:
            return
        self.broken(self.supervisor.timed_out(self.engine.busy(), head.timeout, head.what,
                                              head.replies, head.seq, head.method), head)

    # -- what arrives ----------------------------------------------------------------------
    def dispatch(self, message: tuple) -> None:
        """One message from a rank: an acknowledgement counted into its call; else its
        ledger fields applied here, then a reply or an item to the engine, a death's
        notice judged."""
        if len(message) != 2:  # an acknowledgement (framing.Channel.take): no ledger fields
            engine = self.engine
            engine.ack([message], monotonic())
            if engine.todo or engine.changed:
                self.carry_out()
            return
        header = message[0]
        path = self.path
        assert path is not None
        path.arrived(header)
        kind = header[Field.KIND]
        if kind == REPLY or kind == ITEM:
            engine = self.engine
            engine.feed(message, monotonic())
            if engine.todo or engine.changed:
                self.carry_out()
        elif kind == DEATH:
            self.death(header)

    def death(self, notice: dict[str, Any]) -> None:
        """A rank died (Kind.DEATH): the runner breaks, naming the call it died in."""
        dead = self.supervisor.dead_of(notice)
        if dead is None or self.dying:  # stale, or the first notice judges them all
            return
        self.dying = True
        try:
            begun = self.last_replies(dead)
        finally:
            self.dying = False
        if self.engine.state is not HEALTHY:  # a last reply broke it
            return
        at = self.engine.died_in(dead, begun)
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
        path = self.path
        assert path is not None
        known = [seq for seq in begun.values() if seq is not None]
        give_up = time.monotonic() + (LAST_REPLIES if len(known) == len(begun) else
                                      LAST_REPLIES_UNKNOWN)
        engine = self.engine
        while engine.state is HEALTHY and engine.owes_before(begun):
            now = time.monotonic()
            if now >= give_up:
                break
            message = path.bus.receive(timeouts.wait_ms(give_up - now), acks=True)
            if message is not None:
                self.dispatch(message)
        return min(known, default=0)

    def settle_futures(self) -> None:
        """Outside the lock: futures' callbacks may call the runner."""
        settled = self.engine.settled
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
    def want_collector(self) -> None:
        """Under the lock: a call in flight has no caller watching it."""
        if self.collector is None:
            self.collector = threading.Thread(target=self.collect, daemon=True,
                                              name="reactor-dist-collector")
            self.collector.start()
        else:
            self.wanted.notify()

    def collect(self) -> None:
        engine = self.engine
        self.collector_ident = get_ident()
        try:
            while True:
                with self.lock:
                    if engine.state is not HEALTHY:
                        return
                    if self.receiving or not engine.unwatched():
                        if not engine.settled:
                            self.wanted.wait(WAKE)
                    else:
                        self.serve(time.monotonic(), None)
                self.settle_futures()
        finally:
            self.collector_ident = 0  # (a thread started later may get the same ident)
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
        engine = self.engine
        due = engine.next_deadline()
        if not self.receiving and engine.state is HEALTHY:
            if not self.drain() and due is not None and now >= due:
                self.expire()
            if satisfied():
                return True
            due = engine.next_deadline()
        return due if give_up is None else give_up if due is None else min(due, give_up)

    def add_waker(self, waker: Waker) -> None:
        """Under the lock: a task waits; its loop watches the reply socket meanwhile."""
        self.wakers.append(waker)
        loop = waker.loop
        if loop not in self.readers:  # a count of 0: its reader is still there
            assert self.path is not None
            for closed in [other for other in self.readers if other.is_closed()]:
                del self.readers[closed]  # closed while it kept its reader
            loop.add_reader(self.path.bus.pull_fd, self.readable, loop)
        self.readers[loop] = self.readers.get(loop, 0) + 1

    def remove_waker(self, waker: Waker) -> None:
        """Under the lock: a task stopped waiting.  Its loop keeps the reader: a task that
        awaits call after call waits again before the socket stirs, and registers
        nothing anew (the reader goes when it fires with no task waiting: readable)."""
        self.wakers.remove(waker)
        self.readers[waker.loop] -= 1

    def readable(self, loop: asyncio.AbstractEventLoop) -> None:
        """In ``loop``: the reply socket may have a message; its tasks look.  With none
        waiting, its reader goes: the descriptor stays readable until somebody reads
        the socket, and the loop would spin on it."""
        if self.readers.get(loop):
            for waker in list(self.wakers):
                if waker.loop is loop:
                    waker.set()
            return
        with self.lock:
            if self.readers.get(loop, 1):  # a task waits again, or it went already
                return
            del self.readers[loop]
            if self.path is not None:
                with contextlib.suppress(Exception):  # the bus may be closed by now
                    loop.remove_reader(self.path.bus.pull_fd)

    def drop_readers(self) -> None:
        """Shutdown, before the bus closes: the readers no task uses any more go now
        (a loop's own thread removes it where the loop runs).  A reader left on a
        closed descriptor would meet the next file its loop watches under that
        number."""
        with self.lock:
            idle = [loop for loop, count in self.readers.items() if not count]
            for loop in idle:
                del self.readers[loop]
            fd = self.path.bus.pull_fd if self.path is not None else None
        for loop in idle:
            if fd is None or loop.is_closed():
                continue
            try:
                here = asyncio.get_running_loop() is loop  # shutdown() from a task of it
            except RuntimeError:
                here = False
            if here or not loop.is_running():
                with contextlib.suppress(Exception):
                    loop.remove_reader(fd)
                continue
            removed = threading.Event()
            with contextlib.suppress(RuntimeError):  # closed meanwhile: nothing to remove
                loop.call_soon_threadsafe(_remove_reader, loop, fd, removed)
                removed.wait(WAKE)


def _remove_reader(loop: asyncio.AbstractEventLoop, fd: int, removed: threading.Event) -> None:
    """In ``loop`` (CallQueue.drop_readers): its reader on ``fd`` goes; then ``removed``."""
    with contextlib.suppress(Exception):
        loop.remove_reader(fd)
    removed.set()
