"""Between calls, the caller's releases reach rank 0 without waiting for the next call.

A result segment the application let go (its array was collected) is queued by a
finalizer, which may run in any thread at any moment: it only appends the name and
writes one byte to a pipe (no lock, nothing that could deadlock inside a garbage
collection).  This thread wakes on that byte, waits RELEASE_DELAY so that a call
sent meanwhile takes the names itself (in its RELEASED field, for free), and
publishes what is left as one RELEASE command.  During a call the caller's own
waits pass releases on (:meth:`reactor_dist.caller.reclaim.MemoryReturn.pass_on_releases`).

It also keeps the caller's mappings of rank 0's segments a cache, not a hoard: once
no call was sent for IDLE_RETURN seconds, mappings nobody views are dropped (rank 0
retires its idle segments at the same time; the memory is free once both let go).
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
import time
from collections.abc import Callable

from ..shm.ledger import IDLE_RETURN

RELEASE_DELAY = 0.01  # seconds: a call sent within this time carries the names itself


class Releaser:
    """One thread per runner; :meth:`notify` is what the finalizers call.  Once no call
    was sent for IDLE_RETURN seconds, it also runs ``on_idle`` (once per idle spell)."""

    def __init__(self, pending: Callable[[], bool], pass_on: Callable[[], None],
                 last_call: Callable[[], float], on_idle: Callable[[], None]) -> None:
        self.pending, self.pass_on = pending, pass_on
        self.last_call, self.on_idle = last_call, on_idle
        self._read, self._write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="reactor-dist-releaser",
                                         daemon=True)
        self._thread.start()

    def notify(self) -> None:
        """A name was queued (from a finalizer: must never block or raise)."""
        if self._closed:
            return  # the pipe's descriptors may belong to another file by now
        with contextlib.suppress(OSError):  # full pipe: a wake-up is pending anyway
            os.write(self._write, b"r")

    def _run(self) -> None:
        idled = None  # the last call of the idle spell already handled
        while not self._closed:
            woken, _, _ = select.select([self._read], [], [], IDLE_RETURN / 2)
            if woken:
                with contextlib.suppress(OSError):
                    os.read(self._read, 4096)
                time.sleep(RELEASE_DELAY)
            if self._closed:
                return
            with contextlib.suppress(Exception):  # a bus closing under us: nothing to do
                if self.pending():
                    self.pass_on()
                last = self.last_call()
                if time.perf_counter() - last > IDLE_RETURN and idled != last:
                    idled = last
                    self.on_idle()

    def close(self) -> None:
        """End the thread (and wait for it: it may be publishing) and the pipe."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            os.write(self._write, b"r")  # wake the thread: it sees _closed and ends
        self._thread.join(timeout=5)
        os.close(self._read)
        os.close(self._write)
