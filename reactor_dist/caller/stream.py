"""``runner.stream(x)``: rank 0's items of one step, handed over as they are made.

A worker whose ``generate`` is a generator function yields items; every rank runs
its generator to the end (its collectives stay inside it) and rank 0 sends each
item as an ITEM message the moment it is yielded, by the same path as a result
(big buffers through /dev/shm, ``shared_empty`` without a copy).  A worker whose
``generate`` returns a plain value streams that one value.

The error contract holds per stream: the ranks' outcomes are judged when the step
ends (:func:`reactor_dist.caller.outcome.judge`), after the items made before it.

A stream is one call in the call queue (:mod:`reactor_dist.caller.call_queue`): calls may
be sent behind it while it is open, and its items keep arriving (into the stream)
while another caller receives.  Leaving early (``break``, :meth:`Stream.close`, the
iterator collected) never blocks: the step runs to its end on every rank anyway
(collectives cannot be left halfway) and counts as in flight until then; its
remaining items' segments go back unread.  A Ctrl-C inside ``next()`` ends the
stream like an interrupted ``generate()``.

A stream is read by one thread: the thread that takes its first item owns it, and
``next()`` from any other thread raises RuntimeError at once, touching nothing (two
readers would split its items between them in silence).  ``async for`` over a stream
raises TypeError (async code uses ``runner.astream(x)``); a stream nobody read yet is
left then, so its step ends on every rank and holds up nothing.
"""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Any, NoReturn

from . import blocking
from .calls import hand_out

if TYPE_CHECKING:
    from .call_queue import CallQueue
    from .calls import Call


class Stream:
    """An iterator over rank 0's items of one call (from :meth:`DistributedRunner.stream`)."""

    def __init__(self, queue: CallQueue, call: Call) -> None:
        self._queue = queue
        self._call: Call | None = call
        self.what = f"the stream of {call.what}"
        self._owner: threading.Thread | None = None  # the thread that reads it
        self._claim = threading.Lock()

    @classmethod
    def send(cls, queue: CallQueue, value: Any, timeout: float | None,
             queue_timeout: float | None) -> Stream:
        """Send ``generate(value)`` as a stream's call."""
        return cls(queue, blocking.send_stream(queue, value, timeout, queue_timeout))

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
