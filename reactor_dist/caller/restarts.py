"""Restarts: ``runner.restart()``, and the budget with which a broken runner restarts itself.

A restart moves the call queue's state (:mod:`reactor_dist.caller.call_queue`, where the
moves are)::

    healthy / unusable --restart()--> restarting --ranks back--> healthy
                                          |
                                          +--- it failed, or was interrupted --> unusable
                                               (what start() would raise; every rank ended)

While ``restarting``, every new call waits for the end (at most its
``queue_timeout``).  With ``max_restarts=N`` a crash, a timeout or a desync still fails
the call it happened in and every call behind it (a step is never replayed), and the
runner restarts itself at once, in a thread of its own; past N restarts within
``restart_window`` seconds it stays unusable, and its error lists the failures that
used the budget (a crash loop must not spin).  :class:`Restarts` is the policy and the
driver: it asks the queue for each move and never writes its state.  The ranks' side
of it: :mod:`reactor_dist.caller.recovery`.
"""

from __future__ import annotations

import collections
import logging
import threading
import time

from .. import timeouts
from . import recovery
from .call_queue import CallQueue
from .fault_log import headline, one_line

log = logging.getLogger("reactor_dist")
END_WAIT = 30.0  # seconds restart() waits for a failed restart of its own to end its ranks


def first_line(exc: BaseException) -> str:
    """An exception's first line, for a one-line summary (a bare KeyboardInterrupt has
    none: its type says it)."""
    lines = str(exc).splitlines()
    return lines[0].rstrip(":") if lines else type(exc).__name__



def told(done: recovery.Restarted) -> str:
    """What a restart did, for its log record: who got a new process, who was kept."""
    parts = []
    if done.replaced:
        parts.append(f"new process and load() for rank {', '.join(map(str, done.replaced))}")
    if done.taken:
        parts.append(f"a loaded spare took the place of rank "
                     f"{', '.join(map(str, done.taken))} (rejoin(), no load())")
    if done.kept:
        parts.append(f"rank {', '.join(map(str, done.kept))} kept its model (rejoin())")
    if not done.kept:
        parts.append("no rank kept its model")
    return "; ".join(parts)

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
        """Under the queue's lock, as the runner breaks with ``exc``: None, or it restarts
        itself (the queue moves to ``restarting``) and this note goes on the failed
        calls' errors (the queue says what becomes of each call)."""
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
                f"waits for it")

    def stop(self) -> None:
        """Shutdown: a restart in progress gives up (within a beat) before anything ends."""
        self.queue.supervisor.begin_closing()
        thread = self.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=10)

    def in_background(self) -> None:
        try:
            self.run(self.timeout)
        except BaseException as exc:  # the queue is unusable with it; the log says why
            log.error("the runner could not restart: %s: %s", type(exc).__name__,
                      one_line(exc))

    def run(self, timeout: float | None) -> None:
        """Bring the ranks back (the queue is ``restarting``).  On a failure, or an
        interrupt anywhere in it, the queue is unusable with that failure first and then
        every rank is ended: restart() and shutdown() both work at once after it."""
        queue = self.queue
        supervisor = queue.supervisor
        thread = self.thread
        if thread is not None and thread is not threading.current_thread():
            # restart() right after a restart of its own failed: that one ends its ranks
            # after it moved the queue to unusable; this one starts once they are ended.
            thread.join(timeout=END_WAIT)
        try:
            last_seq, why = queue.take_over_for_restart()
            path = queue.path
            assert path is not None

            def other(header: dict) -> None:  # a message of the calls that failed
                with queue.lock:
                    path.arrived(header)
                    path.discard(header)

            deadline = timeouts.deadline_of(timeout)
            done = recovery.restart(supervisor, rejoin=self.rejoin, grace=self.grace,
                                    timeout=timeout, last_seq=last_seq, other=other)
            session, replayed = queue.session, ""
            if session is not None:  # every rank restores the snapshot; the calls since
                path.ranks = supervisor.ranks
                session.renewed(done.replaced + done.taken)
                kept, seconds = len(session.journal), session.replay(path, deadline, other)
                done = done._replace(seconds=done.seconds + seconds)
                replayed = (f"; every rank restored the snapshot and ran the {kept} call"
                            f"{'s' * (kept != 1)} since it again")
            again = [call.what for call, _ in queue.retrying]  # sent once this returns
            if again:
                replayed += f"; {', '.join(again)} sent again (retry_failed)"
            self.count += 1
            self.last = done
            reason = f" after {headline(why)}" if why else ""
            log.warning("restart %d%s in %.2f s: %s%s", self.count, reason, done.seconds,
                        told(done), replayed,
                        extra={"restart": self.count, "replaced": done.replaced,
                               "kept": done.kept, "taken": done.taken,
                               "restart_seconds": done.seconds})
            queue.restart_ended(None)
        except BaseException as exc:
            if queue.restart_ended(exc):
                supervisor.end_ranks()
            raise

    def budget_note(self) -> str:
        """The failures that used the budget, for the unusable runner's error."""
        if not self.exhausted:
            return ""
        listed = "; ".join(f"{i}. {type(e).__name__}: {first_line(e)}"
                           for i, e in enumerate(self.exhausted, 1))
        return (f" ({len(self.exhausted)} failures within {self.window:g} s, over "
                f"max_restarts={self.max_restarts}: {listed})")
