"""The call forms for a thread, blocking (a task's: :mod:`reactor_dist.caller.aio`).

A thread that waits for anything receives for everybody while nobody else does
(:meth:`reactor_dist.caller.call_queue.CallQueue.pump`); a KeyboardInterrupt reaches it at
once, and the call it waited for is left to the ranks (its answer is discarded).
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any

from ..wire.protocol import Method
from .call_queue import CallQueue
from .calls import Call
from .engine import RESTARTING


def call(queue: CallQueue, method: str, value: Any, timeout: float | None,
         queue_timeout: float | None) -> Any:
    """Send and wait for the answer: rank 0's value, or the contract's error."""
    try:
        with queue.lock:
            sent = queue.send_locked(method, value, timeout, queue_timeout)
            try:
                queue.pump(lambda: sent.done)
            except BaseException:  # interrupted (Ctrl-C): the ranks still run it
                queue.leave(sent)
                raise
    finally:
        if queue.engine.settled:
            queue.settle_futures()
    return sent.result()


def submit(queue: CallQueue, method: str, value: Any, timeout: float | None,
           queue_timeout: float | None) -> Future:
    future: Future = Future()
    queue.send(method, value, timeout, queue_timeout, future)
    return future


def send_stream(queue: CallQueue, value: Any, timeout: float | None,
                queue_timeout: float | None) -> Call:
    """A stream's call: ``generate(value)``, its items handed over as they come."""
    return queue.send(Method.GENERATE, value, timeout, queue_timeout, stream=True)


def next_item(queue: CallQueue, call: Call) -> tuple[bool, Any]:
    """(True, item) for rank 0's next item of ``call``; (False, None) once every rank
    answered and no item is left (then ``call.result()`` is the end)."""
    with queue.lock:
        call.watchers += 1
        try:
            queue.pump(lambda: bool(call.items) or call.done)
        except BaseException:  # interrupted (Ctrl-C): the stream ends
            queue.leave(call)
            raise
        finally:
            queue.unwatch(call)
        if call.items:
            return True, call.items.popleft()
    queue.settle_futures()
    return False, None


def wait_idle(queue: CallQueue, timeout: float | None) -> bool:
    """Until every call sent so far is answered by every rank (True), or ``timeout``
    passed (False); a restart in progress is waited for; raises the failure if the
    runner breaks meanwhile."""
    with queue.lock:
        if queue.engine.state is not RESTARTING:
            queue.engine.check_usable()
        give_up = None if timeout is None else time.monotonic() + timeout
        idle = queue.pump(queue.engine.answered_so_far(), give_up)
        if idle:
            queue.engine.check_usable()  # the runner broke meanwhile: raises, chaining the failure
    queue.settle_futures()
    return idle
