"""``runner.stream(x)``: rank 0's items of one step, handed over as they are made.

A worker whose ``generate`` is a generator function yields items; every rank runs
its generator to the end (its collectives stay inside it) and rank 0 sends each
item as an ITEM message the moment it is yielded, by the same path as a result
(big buffers through /dev/shm, ``shared_empty`` without a copy).  A worker whose
``generate`` returns a plain value streams that one value.

The error contract holds per stream: the ranks' outcomes are judged when the step
ends (:func:`reactor_dist.outcome.judge`), after the items made before it.

A stream is one call in the call queue (:mod:`reactor_dist.call_queue`): calls may
be sent behind it while it is open, and its items keep arriving (into the stream)
while another caller receives.  Leaving early (``break``, :meth:`Stream.close`, the
iterator collected) never blocks: the step runs to its end on every rank anyway
(collectives cannot be abandoned halfway) and counts as in flight until then; its
remaining items' segments go back unread.  A Ctrl-C inside ``next()`` ends the
stream like an interrupted ``generate()``.

A stream is read by one thread: the thread that takes its first item owns it, and
``next()`` from any other thread raises RuntimeError at once, touching nothing (two
readers would split its items between them in silence).  ``async for`` over a stream
raises TypeError (async code uses ``runner.astream(x)``); a stream nobody read yet is
left then, so its step ends on every rank and holds up nothing.

A stream's call is sent inside :func:`sending_stream`, so that an observer's ``sent``
hook (which runs in the sending thread or task) tells it from a ``generate()`` by
:func:`streaming` (traces name its span ``reactor_dist.stream``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

from . import blocking
from .calls import Undecodable
from .protocol import Method

if TYPE_CHECKING:
    from .call_queue import CallQueue
    from .calls import Call


_streaming: ContextVar[bool] = ContextVar("reactor_dist_streaming", default=False)


def streaming() -> bool:
    """In an observer's ``sent``: whether the call being sent is a stream's."""
    return _streaming.get()


@contextlib.contextmanager
def sending_stream() -> Iterator[None]:
    """Around the send of runner.stream()/astream()'s call (a task's context is its own)."""
    token = _streaming.set(True)
    try:
        yield
    finally:
        _streaming.reset(token)


class _Ends(Protocol):
    """Stream and AsyncStream, as hand_out sees them."""

    def close(self) -> None: ...

    def end(self) -> Call | None: ...


def hand_out(stream: _Ends, more: bool, item: Any, stop: type[Exception]) -> Any:
    """What next() gives: an item; at the end the contract's error, a plain worker's
    one value, or ``stop`` after a generator's last item."""
    if more:
        if isinstance(item, Undecodable):  # it did not unpickle here: the step goes on
            stream.close()
            raise item.error
        return item
    ended = stream.end()
    assert ended is not None
    value = ended.result()  # raises the contract's error
    if ended.generator:
        raise stop
    return value


class Stream:
    """An iterator over rank 0's items of one call (from :meth:`DistributedRunner.stream`)."""

    def __init__(self, queue: CallQueue, call: Call) -> None:
        self._queue = queue
        self._call: Call | None = call
        self.what = f"the stream of {call.what}"
        self._owner: threading.Thread | None = None  # the thread that reads it
        self._claim = threading.Lock()

    @classmethod
    def send(cls, queue: CallQueue, value: Any, timeout: float | None) -> Stream:
        """Send ``generate(value)`` as a stream's call (observers see :func:`streaming`)."""
        with sending_stream():
            return cls(queue, queue.send(Method.GENERATE, value, timeout))

    def __iter__(self) -> Stream:
        return self

    def __aiter__(self) -> NoReturn:
        if self._owner is None:  # nobody reads it: its step ends, holding up nothing
            self.close()
        raise TypeError("stream() is iterated with `for`; in async code use `async for item "
                        "in runner.astream(x)`")

    def __await__(self) -> NoReturn:
        if self._owner is None:
            self.close()
        raise TypeError("stream() is not awaited: in async code iterate `async for item in "
                        "runner.astream(x)`, or await runner.agenerate(x) for the list")

    def __next__(self) -> Any:
        owner = self._owner or self._own()
        if owner is not threading.current_thread():
            raise self._not_the_owner(owner)
        call = self._call
        if call is None:
            raise StopIteration
        try:
            more, item = blocking.next_item(self._queue, call)
        except BaseException:  # interrupted: the queue has left the call
            self._call = None
            raise
        return hand_out(self, more, item, StopIteration)

    def _own(self) -> threading.Thread:
        with self._claim:  # two threads' first next() at once: one of them owns it
            if self._owner is None:
                self._owner = threading.current_thread()
            return self._owner

    def _not_the_owner(self, owner: threading.Thread) -> RuntimeError:
        return RuntimeError(
            f"{self.what} is read by one thread: thread {owner.name!r} took its first item, "
            f"so next() from thread {threading.current_thread().name!r} is refused (two "
            "threads would split its items between them). Read it in that one thread and "
            "hand the items to the others through a queue.Queue, or start one "
            "runner.stream(x) per thread")

    def close(self) -> None:
        """Leave the stream: the step still ends on every rank, its other items unread."""
        call, self._call = self._call, None
        if call is not None:
            self._queue.leave_soon(call)

    def end(self) -> Call | None:
        """Every item was taken: the stream is over; its call, for the verdict."""
        call, self._call = self._call, None
        return call

    def __del__(self) -> None:
        if getattr(self, "_call", None) is not None:
            with contextlib.suppress(Exception):  # never raise from a finalizer
                self.close()

    def __repr__(self) -> str:
        state = "open" if self._call is not None else "ended"
        return f"<Stream of {self.what}: {state}>"
