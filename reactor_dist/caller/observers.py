"""What watches calls from outside the call path: metrics (:mod:`reactor_dist.metrics`)
and traces (:mod:`reactor_dist.tracing`) hook in here, and nowhere else.

The call queue tells each :class:`Observer` attached with
:meth:`DistributedRunner.attach_observer` about every call: when it was
sent, when rank 0's first item came, and how it ended (its outcome, its timings).
What an observer gets is frozen: a :class:`CallRecord` made as the call is sent, and a
:class:`CallEnd` as it ends; the call queue's own state of the call stays its own.
A runner with no observer pays one empty-tuple test per call.  The hooks run where
the event happens, most of them under the queue's lock in whichever thread received
the message: an observer must be quick, never block, never call the runner, and
never raise (an exception is logged once and the observer detached).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

# How a call ended (the ``outcome`` label of reactor_dist_calls_total).
OK, RAISED, CRASHED, TIMED_OUT, DESYNC, CANCELLED = (
    "ok", "raised", "crashed", "timed_out", "desync", "cancelled")
OUTCOMES = (OK, RAISED, CRASHED, TIMED_OUT, DESYNC, CANCELLED)
log = logging.getLogger("reactor_dist")


@dataclasses.dataclass(frozen=True)
class CallRecord:
    """One call as observers see it, made as it is sent and never changed (a call that
    retry_failed sends again keeps its record)."""

    seq: int
    method: str
    stream: bool  # sent by stream()/astream() (traces name its span reactor_dist.stream)
    started: float  # perf_counter: send() began
    sent: float  # perf_counter: the CALL was published


@dataclasses.dataclass(frozen=True)
class CallEnd:
    """How a call ended, for observers: its ``outcome`` and error; for an answered call
    the perf_counter readings ``times`` (send began, CALL published, every REPLY in,
    judged), ``compute`` (each rank's seconds inside its worker method) and
    ``collective_wait`` (of those, each rank's seconds in collectives; None without a
    group); None where it did not run to its end."""

    outcome: str
    error: BaseException | None = None
    times: tuple[float, float, float, float] | None = None
    compute: tuple[float, ...] | None = None
    collective_wait: tuple[float, ...] | None = None


class Observer:
    """Subclass and override what you need; every hook is a no-op here."""

    def sent(self, call: CallRecord) -> None:
        """``call`` was published; runs in the caller's thread or task (its context)."""

    def first_item(self, call: CallRecord, at: float) -> None:
        """Rank 0's first item of ``call`` arrived at ``at`` (perf_counter)."""

    def settled(self, call: CallRecord, end: CallEnd) -> None:
        """``call`` ended as ``end`` says."""

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
