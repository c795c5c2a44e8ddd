"""``runner.stream(x)``: rank 0's items of one step, handed over as they are made.

A worker whose ``generate`` is a generator function yields items; every rank runs
its generator to the end (its collectives stay inside it) and rank 0 sends each
item as an ITEM message the moment it is yielded, by the same path as a result
(big buffers through /dev/shm, ``shared_empty`` without a copy).  A worker whose
``generate`` returns a plain value streams that one value.

The error contract holds per stream: the ranks' outcomes are judged when the step
ends (:func:`reactor_dist.outcome.judge`), after the items made before it.

Leaving early (``break``, :meth:`Stream.close`, the iterator collected) never
blocks: the step runs to its end on every rank anyway (collectives cannot be
abandoned halfway); the next call first waits for that end, handing the
remaining items' segments back unread.  A Ctrl-C inside ``next()`` ends the
stream like an interrupted ``generate()``: its late messages are discarded.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from .calls import ENDED, PendingCall
from .errors import WorkerCrashed, WorkerTimeout

if TYPE_CHECKING:
    from .aio import AsyncStream
    from .runner import DistributedRunner


def handed_out(stream: Stream | AsyncStream, pending: PendingCall, item: Any,
               stop: type[Exception]) -> Any:
    """What next() gives for ``item``: the item; at the end (``ENDED``) the contract's
    error, a plain worker's one value, or ``stop`` after a generator's last item."""
    if item is not ENDED:
        return item
    stream._end()
    value = stream._runner._answer(pending)
    if pending.generator:
        raise stop
    return value


class Stream:
    """An iterator over rank 0's items of one call (from :meth:`DistributedRunner.stream`)."""

    def __init__(self, runner: DistributedRunner, pending: PendingCall) -> None:
        self._runner = runner
        self._pending: PendingCall | None = pending
        self.thread = threading.get_ident()  # where it was opened
        self.what = f"the stream of {pending.what}"

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Any:
        runner = self._runner
        with runner._lock:
            pending = self._pending
            if pending is None:
                raise StopIteration
            transport = runner._transport
            try:
                item = transport.next_item(pending)
            except (WorkerCrashed, WorkerTimeout) as exc:
                self._end()
                runner._break(exc)
                raise  # keeps its __cause__
            except KeyboardInterrupt:
                self._end()  # like generate(): the late messages are discarded
                raise
            except Exception:
                self.close()  # an item that did not unpickle here: the step goes on
                raise
            return handed_out(self, pending, item, StopIteration)

    def close(self) -> None:
        """Leave the stream: the step still ends on every rank, its other items unread."""
        runner = self._runner
        with runner._lock:
            pending = self._pending
            if pending is not None:
                if pending.seq == runner._transport.seq:  # no later call discarded its end
                    runner._abandoned = pending  # finished before the next call starts
                self._end()

    def _end(self) -> None:
        runner = self._runner
        self._pending = None
        ref = runner._open
        if ref is not None and ref() in (self, None):
            runner._open = None
            runner._turn.notify_all()

    def __del__(self) -> None:
        if getattr(self, "_pending", None) is not None:
            try:
                self.close()
            except Exception:
                pass  # never raise from a finalizer

    def __repr__(self) -> str:
        state = "open" if self._pending is not None else "ended"
        return f"<Stream of {self.what}: {state}>"
