"""asyncio: the call queue's waits for a task, never blocking the event loop.

A task takes its turn and publishes like a thread (:mod:`reactor_dist.caller.call_queue`),
then waits: it takes whatever the reply socket has without blocking, and otherwise
awaits a :class:`~reactor_dist.caller.call_queue.Waker` that the loop's reader on the socket's
descriptor, or a dispatch in another thread or task, sets.  A death notice arrives on
the same socket, so a crash wakes the waiting task at once.  Up to ``max_in_flight``
calls of different tasks are in flight together, sent in the order the tasks asked.

Cancelling a task raises CancelledError in it at once and leaves the runner healthy:
a call already sent still runs on the ranks and counts as in flight until they
answer it (its answer is discarded); a call still waiting for its turn is never sent.

``runner.areset()`` and ``runner.ashutdown()`` return None, so a missing ``await`` goes
unnoticed: their coroutine, never awaited, warns with what it did not do and what to
write instead (:func:`must_await`), in place of Python's bare "never awaited".
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import sys
import threading
import time
import warnings
from collections.abc import Callable, Coroutine, Generator
from typing import Any, ParamSpec, TypeVar

from ..wire.protocol import Method
from .call_queue import CallQueue, Waker
from .calls import Call, hand_out
from .engine import RESTARTING


async def wait(queue: CallQueue, satisfied: Callable[[], bool],
               give_up: float | None = None) -> bool:
    """Until ``satisfied()`` (True) or the monotonic ``give_up`` (False), receiving
    whatever has arrived whenever nobody else receives."""
    waker = Waker(asyncio.get_running_loop())
    with queue.lock:
        queue.add_waker(waker)
    try:
        while True:
            with queue.lock:
                ready = queue.poll(satisfied, give_up)
            queue.settle_futures()
            if ready is True or ready is False:
                return ready
            await waker.wait(ready)
    finally:
        with queue.lock:
            queue.remove_waker(waker)


async def send(queue: CallQueue, method: str, value: Any, timeout: float | None,
               queue_timeout: float | None, stream: bool = False) -> Call:
    """:meth:`CallQueue.send_locked` for a task: its turn (and a restart in progress)
    is awaited, never blocking the loop.  The fast path is the threads' one: nobody
    is waiting for a turn and there is room in flight, so it is sent at once, under one
    take of the lock."""
    with queue.lock:
        engine = queue.engine
        if engine.free_to_send():
            return queue.send_now(None, method, value, timeout, None, stream)
        turn = engine.take_turn()
    try:
        give_up = None if queue_timeout is None else time.monotonic() + queue_timeout
        while True:
            if not await wait(queue, lambda: engine.may_send(turn), give_up):
                with queue.lock:
                    raise engine.not_sent(method, queue_timeout)
            with queue.lock:
                if engine.may_send(turn):  # still (a restart may have begun meanwhile)
                    engine.check_usable()  # broken as our turn came: why it cannot go
                    return queue.send_now(turn, method, value, timeout, None, stream)
    finally:
        with queue.lock:
            engine.leave_turn(turn)
            queue.carry_out()


async def call(queue: CallQueue, method: str, value: Any, timeout: float | None,
               queue_timeout: float | None) -> Any:
    sent = await send(queue, method, value, timeout, queue_timeout)
    try:
        await wait(queue, lambda: sent.done)
    except BaseException:  # cancelled: the ranks still run it
        with queue.lock:
            queue.leave(sent)
        raise
    return sent.result()


async def wait_idle(queue: CallQueue, timeout: float | None) -> bool:
    """:func:`reactor_dist.caller.blocking.wait_idle` for a task."""
    with queue.lock:
        if queue.engine.state is not RESTARTING:
            queue.engine.check_usable()
        answered = queue.engine.answered_so_far()
    give_up = None if timeout is None else time.monotonic() + timeout
    idle = await wait(queue, answered, give_up)
    if idle:
        queue.engine.check_usable()  # the runner broke meanwhile: raises, chaining the failure
    return idle


def _who() -> str:
    task = asyncio.current_task()
    name = task.get_name() if task is not None else "no task"
    return f"task {name!r} in thread {threading.current_thread().name!r}"


class AsyncStream:
    """``async for item in runner.astream(x)``: :class:`reactor_dist.caller.stream.Stream`'s
    rules, awaited.  The call is sent at the first ``__anext__``.

    One reader at a time: an ``__anext__`` while another task's (or another loop's) is
    still waiting raises RuntimeError at once, touching nothing, since two readers would
    split the items between them (and two first ones would send the call twice).  Taking
    turns is fine, so ``asyncio.wait_for(stream.__anext__(), t)`` works."""

    def __init__(self, queue: CallQueue, value: Any, timeout: float | None,
                 queue_timeout: float | None) -> None:
        self._queue, self._value = queue, value
        self._timeout, self._queue_timeout = timeout, queue_timeout
        self._call: Call | None = None
        self._done = False
        self._reading = threading.Lock()  # held by the one __anext__ under way
        self._reader = ""

    def __aiter__(self) -> AsyncStream:
        return self

    def __iter__(self):
        raise TypeError("astream() is iterated with `async for`; in synchronous code use "
                        "runner.stream()")

    def __await__(self):
        raise TypeError("astream() is not awaited: iterate it with `async for item in "
                        "runner.astream(x)`, or await runner.agenerate(x) for the list")

    async def __anext__(self) -> Any:
        if not self._reading.acquire(blocking=False):
            raise RuntimeError(
                f"this astream() is read by one task at a time: {self._reader} is awaiting "
                f"its next item, so __anext__() from {_who()} is refused (two readers would "
                "split its items between them). Read it with one `async for` and hand the "
                "items to other tasks through an asyncio.Queue, or start one "
                "runner.astream(x) per task")
        try:
            self._reader = _who()
            return await self._next()
        finally:
            self._reading.release()

    async def _next(self) -> Any:
        if self._done:
            raise StopAsyncIteration
        queue = self._queue
        if self._call is None:
            try:
                self._call = await send(queue, Method.GENERATE, self._value,
                                        self._timeout, self._queue_timeout, stream=True)
            except BaseException:
                self._done = True
                raise
        sent = self._call
        try:
            await wait(queue, lambda: bool(sent.items) or sent.done)
        except BaseException:  # cancelled: the step goes on, its items go back unread
            self.close()
            raise
        with queue.lock:
            more = bool(sent.items)
            item = sent.items.popleft() if more else None
        return hand_out(self, more, item, StopAsyncIteration)

    async def aclose(self) -> None:
        """Leave the stream: the step still ends on every rank, its other items unread."""
        self.close()

    def close(self) -> None:
        sent, self._call = self._call, None
        self._done = True
        if sent is not None:
            self._queue.leave_soon(sent)

    def end(self) -> Call | None:
        """Every item was taken: the stream is over; its call, for the verdict."""
        sent, self._call = self._call, None
        self._done = True
        return sent

    def __del__(self) -> None:
        if not getattr(self, "_done", True):
            with contextlib.suppress(Exception):  # never raise from a finalizer
                self.close()


P = ParamSpec("P")
T = TypeVar("T")

# What a method's coroutine, never awaited, did not do; and its synchronous twin.
_NOT_DONE = {
    "areset": ("reset() did not run on the ranks: they keep their session state", "reset"),
    "ashutdown": ("the runner was not shut down: its ranks keep running until "
                  "runner.shutdown() or the interpreter's exit", "shutdown"),
}


class _MustAwait(Coroutine):
    """A coroutine that, collected without ever running, warns what to write instead.

    It is a :class:`collections.abc.Coroutine`, so ``await``, ``create_task`` and
    ``asyncio.run`` take it as they take the coroutine it wraps, cancellation included."""

    __slots__ = ("_coro", "_ran", "_warning", "_at")

    def __init__(self, coro: Coroutine, warning: str, at: tuple[str, int, str]) -> None:
        self._coro, self._warning, self._at = coro, warning, at
        self._ran = False

    def __await__(self) -> Generator[Any, None, Any]:
        self._ran = True
        return self._coro.__await__()

    def send(self, value: Any) -> Any:
        self._ran = True
        return self._coro.send(value)

    def throw(self, *exc: Any) -> Any:
        self._ran = True
        return self._coro.throw(*exc)

    def close(self) -> None:
        self._ran = True
        self._coro.close()

    def __del__(self) -> None:
        if not getattr(self, "_ran", True):
            self._coro.close()  # an unstarted coroutine, closed: no warning of Python's own
            filename, lineno, module = self._at
            warnings.warn_explicit(self._warning, RuntimeWarning, filename, lineno, module)


def must_await(method: Callable[P, Coroutine[Any, Any, T]]
               ) -> Callable[P, Coroutine[Any, Any, T]]:
    """The runner's ``areset``/``ashutdown``: never awaited, they warn, at the caller's
    line, what did not happen and what to write (``await runner.X()``, or the sync X)."""
    name = method.__name__
    not_done, sync = _NOT_DONE[name]
    warning = (f"runner.{name}() was never awaited, so {not_done}. In async code write "
               f"`await runner.{name}()`; outside async code call runner.{sync}()")

    @functools.wraps(method)
    def call(*args: P.args, **kwargs: P.kwargs) -> Coroutine[Any, Any, T]:
        caller = sys._getframe(1)
        at = (caller.f_code.co_filename, caller.f_lineno,
              caller.f_globals.get("__name__", "__main__"))
        return _MustAwait(method(*args, **kwargs), warning, at)

    return call
