"""What watches calls from outside the call path: metrics (:mod:`reactor_dist.metrics`)
and traces (:mod:`reactor_dist.tracing`) hook in here, and nowhere else.

The call queue tells each :class:`Observer` attached with
:meth:`DistributedRunner.attach_observer` about every call: when it was
sent, when rank 0's first item came, and how it ended (its outcome, its timings).
A runner with no observer pays one empty-tuple test per call.  The hooks run where
the event happens, most of them under the queue's lock in whichever thread received
the message: an observer must be quick, never block, never call the runner, and
never raise (an exception is logged once and the observer detached).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .calls import Call

# How a call ended (the ``outcome`` label of reactor_dist_calls_total).
OK, RAISED, CRASHED, TIMED_OUT, DESYNC, CANCELLED = (
    "ok", "raised", "crashed", "timed_out", "desync", "cancelled")
OUTCOMES = (OK, RAISED, CRASHED, TIMED_OUT, DESYNC, CANCELLED)
log = logging.getLogger("reactor_dist")


class Observer:
    """Subclass and override what you need; every hook is a no-op here."""

    def sent(self, call: Call) -> None:
        """``call`` was published; runs in the caller's thread or task (its context)."""

    def first_item(self, call: Call, at: float) -> None:
        """Rank 0's first item of ``call`` arrived at ``at`` (perf_counter)."""

    def settled(self, call: Call, outcome: str,
                times: tuple[float, float, float, float] | None,
                compute: tuple[float, ...] | None) -> None:
        """``call`` ended with ``outcome``; for an answered call ``times`` are the
        perf_counter readings (send began, CALL published, every REPLY in, judged) and
        ``compute`` each rank's seconds inside its worker method (``call.collective_wait``:
        of those, each rank's seconds in collectives, None without a group)."""

    def died(self, ranks: list[int]) -> None:
        """``ranks`` were found dead (the runner raises WorkerCrashed)."""

    def lifecycle(self, name: str, began: float, ended: float,
                  error: BaseException | None) -> None:
        """``start`` or ``restart`` ran from ``began`` to ``ended`` (perf_counter), in
        the caller's thread; ``error``: what it raised."""


def tell(observers: tuple[Observer, ...], hook: str, *args: Any) -> tuple[Observer, ...]:
    """Call ``hook`` on every observer; the ones that raise are left out of what this
    returns (the caller keeps that as its observers)."""
    kept = observers
    for observer in observers:
        try:
            getattr(observer, hook)(*args)
        except Exception as exc:
            log.error("observer %r raised in %s() and was detached: %s: %s", observer, hook,
                      type(exc).__name__, exc)
            kept = tuple(o for o in kept if o is not observer)
    return kept
