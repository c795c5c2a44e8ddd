"""Restarts: ``runner.restart()``, and the budget with which a broken runner restarts itself.

A restart goes through the call queue's states::

    ready / unusable --restart()--> restarting --ranks back--> ready
                                        |
                                        +--- it failed ------> unusable (what start()
                                                               would raise; every rank
                                                               ended)

While ``restarting``, a new call waits for the end (at most its own timeout).  With
``max_restarts=N`` a crash, a timeout or a desync still fails the call it happened in
and every call behind it (a step is never replayed), and the runner restarts itself
at once, in a thread of its own; past N restarts within ``restart_window`` seconds it
stays unusable, and its error lists the failures that used the budget (a crash loop
must not spin).  The ranks' side of it: :mod:`reactor_dist.recovery`.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import TYPE_CHECKING

from . import recovery
from .errors import CallQueueFull
from .receiving import WAKE

if TYPE_CHECKING:
    from .call_queue import CallQueue

RESTARTING = "restarting"
log = logging.getLogger("reactor_dist")


class Restarts:
    """How many restarts so far, the budget, and the restart itself, of one runner."""

    def __init__(self, queue: CallQueue, *, rejoin: bool, grace: float, max_restarts: int,
                 window: float, timeout: float | None) -> None:
        self.queue, self.rejoin, self.grace = queue, rejoin, grace
        self.max_restarts, self.window, self.timeout = max_restarts, window, timeout
        self.count = 0
        self.spent: collections.deque[tuple[float, BaseException]] = collections.deque()
        self.exhausted: list[BaseException] = []  # the budget's failures, once used up
        self.thread: threading.Thread | None = None
        self.last: recovery.Restarted | None = None

    def after_failure(self, exc: BaseException) -> str | None:
        """Under the lock, as the runner breaks with ``exc``: None, or it restarts itself
        (the queue turns ``restarting``) and this note goes on the failed calls' errors."""
        if self.max_restarts <= 0:
            return None
        now = time.monotonic()
        while self.spent and now - self.spent[0][0] > self.window:
            self.spent.popleft()
        if len(self.spent) >= self.max_restarts:
            self.exhausted = [e for _, e in self.spent] + [exc]
            return None
        self.spent.append((now, exc))
        self.thread = threading.Thread(target=self.in_background, daemon=True,
                                       name="reactor-dist-restart")
        self.thread.start()
        return (f"the runner is restarting (restart {len(self.spent)} of "
                f"max_restarts={self.max_restarts} within {self.window:g} s): the next call "
                f"waits for it; this call is not replayed")

    def stop(self) -> None:
        """Shutdown: a restart in progress gives up (within a beat) before anything ends."""
        self.queue.supervisor.closing = True
        thread = self.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=10)

    def begin(self) -> None:
        """restart() from the caller: the calls in flight fail; new ones wait for it."""
        queue = self.queue
        with queue.lock:
            if queue.state == queue.CLOSED:
                raise RuntimeError("this DistributedRunner was shut down: restart() brings "
                                   "back a runner that broke, not one shut down; build a new one")
            if queue.state == queue.NEW:
                raise RuntimeError("start() has not run: call runner.start() first")
            while queue.state == RESTARTING:  # a restart of its own (max_restarts) runs
                queue.receiver.wait(WAKE)
            if queue.state == queue.HEALTHY:
                queue.failure = None
                queue.fail_in_flight(lambda call: RuntimeError(
                    f"{call.what} was in flight when runner.restart() was called: it has "
                    f"no result"))
            queue.state = RESTARTING
            queue.receiver.changed_all()

    def ended(self, failure: BaseException | None) -> None:
        """The restart ended: ready again, or unusable with ``failure``."""
        queue = self.queue
        with queue.lock:
            if queue.state != RESTARTING:
                return  # shut down meanwhile
            if failure is None:
                assert queue.path is not None
                queue.path.ranks = queue.supervisor.ranks  # type: ignore[assignment]
                queue.state, queue.failure = queue.HEALTHY, None
            else:
                queue.state, queue.failure = queue.UNUSABLE, failure
            queue.receiver.changed_all()

    def wait(self, method: str, timeout: float | None) -> None:
        """Under the lock: a call made while the runner restarts waits for it."""
        queue = self.queue
        give_up = None if timeout is None else time.monotonic() + timeout
        while queue.state == RESTARTING:
            now = time.monotonic()
            if give_up is not None and now >= give_up:
                raise CallQueueFull(
                    f"{method}() waited {timeout:g} s for the runner's restart to end; "
                    f"nothing was sent (the restart goes on)")
            queue.receiver.wait(WAKE if give_up is None else min(WAKE, give_up - now))

    def in_background(self) -> None:
        try:
            self.run(self.timeout)
        except BaseException as exc:  # the queue is unusable with it; the log says why
            log.error("the runner could not restart: %s: %s", type(exc).__name__, exc)

    def run(self, timeout: float | None) -> None:
        """Bring the ranks back (the queue is ``restarting``); on a failure every rank is
        ended and the queue is unusable with that failure."""
        queue = self.queue
        supervisor = queue.supervisor
        with queue.lock:
            queue.receiver.wait_for_receiver()
            path = queue.path
            assert path is not None
            last_seq, why = path.seq, queue.failure
        queue.receiver.stop_collector()

        def other(header: dict) -> None:  # a message of the calls that failed
            with queue.lock:
                path.arrived(header)
                path.discard(header)

        try:
            done = recovery.restart(supervisor, rejoin=self.rejoin, grace=self.grace,
                                    timeout=timeout, last_seq=last_seq, other=other)
        except BaseException as exc:
            supervisor.end_ranks()
            self.ended(exc)
            raise
        self.count += 1
        self.last = done
        reason = f" after {type(why).__name__}: {str(why).splitlines()[0].rstrip(':')}" \
            if why else ""
        log.warning("restart %d%s: new process and load() for rank %s, %s in %.2f s",
                    self.count, reason, ", ".join(map(str, done.replaced)),
                    f"rank {', '.join(map(str, done.kept))} kept its model (rejoin())"
                    if done.kept else "no rank kept its model", done.seconds,
                    extra={"restart": self.count, "replaced": done.replaced,
                           "kept": done.kept, "restart_seconds": done.seconds})
        self.ended(None)

    def budget_note(self) -> str:
        """The failures that used the budget, for the unusable runner's error."""
        if not self.exhausted:
            return ""
        listed = "; ".join(f"{i}. {type(e).__name__}: {str(e).splitlines()[0]}"
                           for i, e in enumerate(self.exhausted, 1))
        return (f" ({len(self.exhausted)} failures within {self.window:g} s, over "
                f"max_restarts={self.max_restarts}: {listed})")
