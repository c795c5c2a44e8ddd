"""asyncio: calls that never block the event loop, with no thread per call.

A call is published as in the synchronous path, then its replies are taken without
blocking whenever the PULL socket has some: the loop watches the socket's file
descriptor (``loop.add_reader``) and ZeroMQ's ``EVENTS`` says whether a message is
really there (the descriptor only says "something changed").  A death notice
arrives on the same socket, so a crash wakes the waiting task at once.

Tasks take turns through one ``asyncio.Lock`` (first come, first served); a sync
call from another thread waits for an async call like for a stream.  Cancelling
a task that awaits a call raises CancelledError in it at once and leaves the
runner healthy: the ranks finish the step, and its late reply is discarded by
its sequence number, as after a Ctrl-C.  ``astart``/``ashutdown`` run the
blocking start-up and shutdown in a worker thread (once per runner, not per call).
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

import zmq

from . import timeouts
from .calls import PendingCall
from .errors import WorkerCrashed, WorkerTimeout
from .outcome import judge
from .protocol import Method
from .stream import handed_out
from .transport import Transport

if TYPE_CHECKING:
    from .runner import DistributedRunner

OTHER_THREAD_POLL = 0.005  # how often a task looks whether another thread's call ended


class Readable:
    """Wakes a task when the PULL socket may have a message: the loop watches the
    socket's descriptor for the whole call, and ZeroMQ's EVENTS says whether a message
    is really there (the descriptor only says that something changed)."""

    def __init__(self, sock: zmq.Socket, fd: int) -> None:
        self.sock = sock
        self.loop = asyncio.get_running_loop()
        self.fd = fd
        self.woken: asyncio.Future | None = None
        self.loop.add_reader(fd, self._wake)

    def _wake(self) -> None:
        if self.woken is not None and not self.woken.done():
            self.woken.set_result(None)

    async def wait(self, timeout: float | None) -> None:
        """Until a message may be there, or ``timeout`` seconds passed (the caller has
        just seen that none is)."""
        self.woken = woken = self.loop.create_future()
        timer = None if timeout is None else \
            self.loop.call_later(timeouts.slice_of(timeout), self._wake)  # the caller loops on
        try:
            await woken
        finally:
            self.woken = None
            if timer is not None:
                timer.cancel()

    def close(self) -> None:
        self.loop.remove_reader(self.fd)


async def collect(transport: Transport, pending: PendingCall, until_item: bool = False) -> None:
    """:meth:`Transport.collect` for a task: the same rules, the loop never blocked."""
    bus = transport.bus
    assert bus is not None
    timeout = pending.timeout
    deadline = None if timeout is None else time.monotonic() + timeout
    readable = Readable(bus.pull, bus.pull_fd)
    try:
        while len(pending.replies) < transport.world_size:
            transport.flush()
            # Ask ZeroMQ first: a receive that finds nothing costs an exception.
            if not bus.pull_events() & zmq.POLLIN:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    silent = [r for r in range(transport.world_size)
                              if r not in pending.replies]
                    raise transport.timed_out(silent, timeout, pending.what, pending.replies)
                await readable.wait(left)
                continue
            message = bus.receive(0)
            if message is None:
                continue  # a stranger's message, dropped
            header, body = transport.arrived(message)
            if transport.take(pending, header, body):
                if until_item:
                    return
                if timeout is not None:
                    deadline = time.monotonic() + timeout
    finally:
        readable.close()


class Turn:
    """One task's turn at the runner: other tasks queue behind it, other threads wait."""

    def __init__(self, runner: DistributedRunner, what: str) -> None:
        self.runner, self.what = runner, what
        self.thread = threading.get_ident()
        self._entered = False

    async def __aenter__(self) -> Turn:
        await self.runner._task_lock().acquire()
        self._entered = True
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        self.leave()

    def leave(self) -> None:
        runner = self.runner
        with runner._lock:
            ref = runner._open
            if ref is not None and ref() in (self, None):
                runner._open = None
                runner._turn.notify_all()
        if self._entered:
            self._entered = False
            runner._task_lock().release()

    async def send(self, method: str, value: Any, timeout: float | None) -> PendingCall:
        """Publish once no other thread's stream or call is open and a stream left early
        has ended (awaited, never blocking the loop)."""
        from .runner import READY

        runner, transport = self.runner, self.runner._transport
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with runner._lock:
                holder = runner._open() if runner._open is not None else None
                if holder is None or holder.thread == threading.get_ident():
                    if runner._state[0] != READY or runner._abandoned is None:
                        pending = runner._send(method, value, timeout)  # raises if unusable
                        runner._open = weakref.ref(self)
                        return pending
                    abandoned, runner._abandoned = runner._abandoned, None
                else:
                    abandoned = None
            if abandoned is None:  # another thread's stream or call is open
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"{holder.what} is still open in another thread after {timeout:g} s: "
                        f"this call waited for it and gave up (nothing was sent; the runner "
                        f"stays healthy)")
                await asyncio.sleep(OTHER_THREAD_POLL)
                continue
            abandoned.abandon()
            try:
                await collect(transport, abandoned)
            except (WorkerCrashed, WorkerTimeout) as exc:
                runner._break(exc)
                raise  # keeps its __cause__
            verdict = judge(abandoned.method, transport.outcomes(abandoned))
            if verdict.breaks:
                raise runner._break(verdict.error)


async def call(runner: DistributedRunner, method: str, value: Any,
               timeout: float | None) -> Any:
    async with Turn(runner, f"{method}()") as turn:
        pending = await turn.send(method, value, timeout)
        try:
            await collect(runner._transport, pending)
        except (WorkerCrashed, WorkerTimeout) as exc:
            runner._break(exc)
            raise  # keeps its __cause__
        return runner._answer(pending)


class AsyncStream:
    """``async for item in runner.astream(x)``: :class:`reactor_dist.stream.Stream`'s
    rules, awaited.  The call starts at the first ``__anext__``."""

    def __init__(self, runner: DistributedRunner, value: Any, timeout: float | None) -> None:
        self._runner, self._value, self._timeout = runner, value, timeout
        self._turn: Turn | None = None
        self._pending: PendingCall | None = None
        self._done = False

    def __aiter__(self) -> AsyncStream:
        return self

    def __iter__(self):
        raise TypeError("astream() is iterated with `async for`; in synchronous code use "
                        "runner.stream()")

    def __await__(self):
        raise TypeError("astream() is not awaited: iterate it with `async for item in "
                        "runner.astream(x)`, or await runner.agenerate(x) for the list")

    async def __anext__(self) -> Any:
        if self._done:
            raise StopAsyncIteration
        runner = self._runner
        if self._turn is None:
            self._turn = Turn(runner, "astream()")
            await self._turn.__aenter__()
            try:
                self._pending = await self._turn.send(Method.GENERATE, self._value,
                                                      self._timeout)
            except BaseException:
                self._end()
                raise
        pending = self._pending
        assert pending is not None
        transport = runner._transport
        try:
            while not pending.items and len(pending.replies) < transport.world_size:
                await collect(transport, pending, until_item=True)
            item = transport.next_item(pending)  # never waits now
        except (WorkerCrashed, WorkerTimeout) as exc:
            self._end()
            runner._break(exc)
            raise  # keeps its __cause__
        except (asyncio.CancelledError, KeyboardInterrupt):
            self._end()  # like a Ctrl-C: the late messages are discarded
            raise
        except Exception:
            await self.aclose()  # an item that did not unpickle here: the step goes on
            raise
        return handed_out(self, pending, item, StopAsyncIteration)

    async def aclose(self) -> None:
        """Leave the stream: the step still ends on every rank, its other items unread."""
        self.close()

    def close(self) -> None:
        pending = self._pending
        if pending is not None and not self._done:
            runner = self._runner
            with runner._lock:
                if pending.seq == runner._transport.seq:
                    runner._abandoned = pending
        self._end()

    def _end(self) -> None:
        self._done = True
        self._pending = None
        turn, self._turn = self._turn, None
        if turn is not None:
            turn.leave()

    def __del__(self) -> None:
        if not getattr(self, "_done", True):
            try:
                self.close()
            except Exception:
                pass  # never raise from a finalizer
