"""Who reads the reply socket, and how every other caller waits meanwhile.

One PULL socket carries the answers of every call in flight, so one caller at a time
receives (:attr:`Receiver.receiving`) and dispatches each message to its call by
sequence number (:meth:`CallQueue.dispatch`); the others wait on a condition (threads)
or a :class:`Waker` (asyncio tasks) that every dispatch wakes.  Whoever waits
receives: a thread blocks in ZeroMQ with the lock released; a task only takes what
has arrived and then awaits the socket's descriptor, so the loop never blocks.  When
calls are in flight that nobody waits for (``submit()``'s, or calls left by Ctrl-C,
a cancelled task or a stream left early), the collector thread receives for them, so
that futures settle, crashes are reported and abandoned answers go back at once.

A deadline is only declared passed by a receiver that found nothing more to read: a
call's ``timeout`` bounds, from when the ranks start it, each wait for its next reply
or item (:meth:`Receiver.next_deadline`).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import zmq

from . import timeouts

if TYPE_CHECKING:
    from .call_queue import CallQueue

WAKE = 0.25  # seconds: the longest one receive or wait lasts before its waiter looks again
WAKE_MS = timeouts.wait_ms(WAKE)
POLLIN = int(zmq.POLLIN)  # a plain int: pyzmq's flag enums cost microseconds a test
DRAIN_MOST = 64  # messages one asyncio poll takes before it lets the loop run


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
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
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


class Receiver:
    """The receive role, the waits of every caller, and the collector thread of one
    :class:`~reactor_dist.call_queue.CallQueue` (whose lock guards all of it)."""

    def __init__(self, queue: CallQueue) -> None:
        self.queue = queue
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)  # something arrived or a turn moved
        self.wanted = threading.Condition(self.lock)  # a call has nobody waiting for it
        self.receiving = False  # a caller owns the reply socket now
        self.waiting = 0  # threads in changed.wait() (none: no notify to pay for)
        self.sending = False  # a caller is between encode and publish
        self.wakers: list[Waker] = []
        self.readers: dict[asyncio.AbstractEventLoop, int] = {}  # tasks waiting, per loop
        self.collector: threading.Thread | None = None

    # -- threads ----------------------------------------------------------------------------
    def pump(self, satisfied: Callable[[], bool], give_up: float | None = None) -> bool:
        """Under the lock: receive (or let the receiver receive) until ``satisfied()``
        (True) or the monotonic ``give_up`` passed (False)."""
        while not satisfied():
            now = time.monotonic()
            if give_up is not None and now >= give_up:
                return False
            if self.receiving:
                self.wait(WAKE if give_up is None else min(give_up - now, WAKE))
            else:
                self.serve(now, give_up)
        return True

    def serve(self, now: float, give_up: float | None) -> None:
        """As the receiver: one message (waiting until the next deadline or ``give_up``);
        a passed deadline with nothing left to read breaks the runner."""
        queue = self.queue
        if queue.left:
            queue.take_left()
        if queue.answered_due:
            queue.tell_answered()
        due = self.next_deadline()
        if due is not None and now >= due:
            if not self.drain():
                self.expire(now)
            return
        until = due if give_up is None else give_up if due is None else min(due, give_up)
        path = queue.path
        assert path is not None
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
                if queue.settled:
                    queue.settle_futures()
                message = path.bus.receive(wait_ms)
            finally:
                self.lock.acquire()
            if message is not None:
                path.arrived(message[0])
                queue.dispatch(message)
        finally:
            self.receiving = False
            if self.waiting or self.wakers or self.collector is not None:
                self.changed_all()

    def drain(self) -> bool:
        """Without waiting: dispatch what has arrived (True if anything did)."""
        path = self.queue.path
        assert path is not None and not self.receiving
        if self.queue.left:
            self.queue.take_left()
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
                self.queue.dispatch(message)
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
        """Under the lock: until no caller receives or sends (shutdown)."""
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

    # -- deadlines --------------------------------------------------------------------------
    def next_deadline(self) -> float | None:
        """The moment the call the ranks run runs out of time waiting for its next reply
        or item (None: it cannot).  A call behind it has no clock yet: its own starts
        when the ranks start it, and until then the call they run is the one that can be
        late (and the one a timeout names)."""
        in_flight = self.queue.in_flight
        return in_flight[0].deadline if in_flight else None

    def expire(self, now: float) -> None:
        """Nothing more arrived and the deadline of the call the ranks run passed: it
        timed out; the runner breaks."""
        queue = self.queue
        assert queue.in_flight
        head = queue.in_flight[0]
        silent = [r for r in range(queue.world_size) if r not in head.replies]
        queue.broken(queue.supervisor.timed_out(silent, head.timeout, head.what,
                                               head.replies), head)

    # -- the collector ----------------------------------------------------------------------
    def unwatched(self) -> bool:
        return any(call.watchers <= 0 for call in self.queue.in_flight)

    def want_collector(self) -> None:
        """Under the lock: a call in flight has nobody waiting for it."""
        if self.collector is None:
            self.collector = threading.Thread(target=self.collect, daemon=True,
                                              name="reactor-dist-collector")
            self.collector.start()
        else:
            self.wanted.notify()

    def collect(self) -> None:
        queue = self.queue
        try:
            while True:
                with self.lock:
                    if queue.state != queue.HEALTHY:
                        return
                    if self.receiving or not self.unwatched():
                        if not queue.settled:
                            self.wanted.wait(WAKE)
                    else:
                        self.serve(time.monotonic(), None)
                queue.settle_futures()
        finally:
            queue.settle_futures()

    def stop_collector(self) -> None:
        """Outside the lock, once the queue is closed: the collector ends."""
        collector = self.collector
        if collector is not None and collector is not threading.current_thread():
            with self.lock:
                self.wanted.notify_all()
            collector.join(timeout=4 * WAKE)
            if not collector.is_alive():
                self.collector = None  # a new one starts at the next need (after a restart)

    # -- asyncio ----------------------------------------------------------------------------
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
        if not self.receiving:
            if not self.drain() and due is not None and now >= due:
                self.expire(now)
            if satisfied():
                return True
            due = self.next_deadline()
        return due if give_up is None else give_up if due is None else min(due, give_up)

    def add_waker(self, waker: Waker) -> None:
        """Under the lock: a task waits; its loop watches the reply socket meanwhile."""
        self.wakers.append(waker)
        loop = waker.loop
        if not self.readers.get(loop):
            path = self.queue.path
            assert path is not None
            loop.add_reader(path.bus.pull_fd, self.readable, loop)
        self.readers[loop] = self.readers.get(loop, 0) + 1

    def remove_waker(self, waker: Waker) -> None:
        self.wakers.remove(waker)
        loop = waker.loop
        self.readers[loop] -= 1
        if not self.readers[loop]:
            del self.readers[loop]
            path = self.queue.path
            if path is not None and not loop.is_closed():
                with contextlib.suppress(Exception):  # the bus may be closed by now
                    loop.remove_reader(path.bus.pull_fd)

    def readable(self, loop: asyncio.AbstractEventLoop) -> None:
        """In ``loop``: the reply socket may have a message; its tasks look."""
        for waker in list(self.wakers):
            if waker.loop is loop:
                waker.set()
