"""OpenTelemetry traces: each call a span inside the caller's own trace.

An application that has set a tracer provider (``trace.set_tracer_provider(...)``)
gets, from every runner it starts, one span per call (``reactor_dist.generate``,
``reactor_dist.stream``, ``reactor_dist.reset``) and one per ``start()`` and
``restart()`` (``reactor_dist.start``, ``reactor_dist.restart``), each a child of the
span current where the call was made, so a request's trace shows the model step inside
it.  A span carries the world size, the call number, each rank's compute seconds, the
slowest rank and the outcome (:data:`reactor_dist.caller.observers.OUTCOMES`); a failed call's
error is recorded on it (an exception event, status ERROR); rank 0's first item is an
event ``reactor_dist.first_item``.

**Trigger.**  ``start()`` calls :func:`instrument_if_configured` only when
``opentelemetry.trace`` is already in ``sys.modules`` (the application imported it);
that attaches a :class:`TracingObserver` when the global provider is a real one (not
the API's default proxy or no-op).  Without OpenTelemetry, or with no provider set
before ``start()``, nothing is imported and nothing is done: the cost is one dict
lookup per ``start()``.  :func:`instrument` attaches one explicitly (any provider, any
time); :func:`uninstrument` removes it.

All of this rides on :class:`reactor_dist.caller.observers.Observer`: ``sent`` runs in the
caller's thread or task, so the span starts there, in the caller's context; it is kept
by the call's record (``TracingObserver.spans``) and ended by ``settled``, in
whichever thread received the last reply (under the call queue's lock: a span
processor there must not block, as ``BatchSpanProcessor`` does not).  Times are the
queue's own ``perf_counter`` readings, turned into wall-clock nanoseconds by an offset
read again at most once a second (the wall clock can be stepped or slewed apart from
``perf_counter``: a stale offset put a restart's span 2 ms before its parent's): a call's
span keeps the offset its start was stamped with, so its events and end lie inside it,
and a ``start()``/``restart()`` span is stamped with an offset read when it is reported.
"""

from __future__ import annotations

import time
import weakref
from typing import Any, Protocol

from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from .caller.observers import CallEnd, CallRecord, Observer


class DistributedRunner(Protocol):
    """What tracing needs of a runner (reactor_dist.DistributedRunner): no import of it."""

    @property
    def world_size(self) -> int: ...

    def attach_observer(self, observer: Observer) -> None: ...

    def detach_observer(self, observer: Observer) -> None: ...

# Each runner's observer; None: uninstrument() was called (start() leaves it untraced).
_attached: weakref.WeakKeyDictionary[DistributedRunner, TracingObserver | None] = \
    weakref.WeakKeyDictionary()


def configured() -> bool:
    """Whether the application has set a global tracer provider of its own."""
    provider = trace.get_tracer_provider()
    return not isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider))


OFFSET_MAX_AGE = 1.0  # seconds a perf_counter -> wall-clock offset is used before read again


def clock_offset_ns(samples: int = 8) -> int:
    """perf_counter ns -> wall-clock ns (spans are stamped in epoch ns): the wall clock
    read between two perf_counter readings, from the tightest of ``samples`` brackets, so
    that a thread preempted between two reads (a loaded machine) does not shift every
    span of the runner by as long as it waited."""
    brackets = []
    for _ in range(samples):
        before = time.perf_counter_ns()
        wall = time.time_ns()
        after = time.perf_counter_ns()
        brackets.append((after - before, wall - (before + after) // 2))
    return min(brackets)[1]


class TracingObserver(Observer):
    """Spans for one runner's calls, start and restarts (see the module docstring)."""

    def __init__(self, world_size: int,
                 tracer_provider: trace.TracerProvider | None = None) -> None:
        self.world_size = world_size
        self.tracer = trace.get_tracer("reactor_dist", tracer_provider=tracer_provider)
        self.offset_ns = clock_offset_ns()
        self.offset_read = time.perf_counter()
        # the open span of each call in flight, with the offset its start was stamped with
        self.spans: dict[CallRecord, tuple[Any, int]] = {}

    def current_offset(self) -> int:
        now = time.perf_counter()
        if now - self.offset_read > OFFSET_MAX_AGE:
            self.offset_ns, self.offset_read = clock_offset_ns(), now
        return self.offset_ns

    def sent(self, call: CallRecord) -> None:
        name = "stream" if call.stream else call.method
        offset = self.current_offset()
        self.spans[call] = (self.tracer.start_span(
            f"reactor_dist.{name}", start_time=wall_ns(call.started, offset),
            attributes={"reactor_dist.world_size": self.world_size,
                        "reactor_dist.call": call.seq}), offset)

    def first_item(self, call: CallRecord, at: float) -> None:
        open_span = self.spans.get(call)
        if open_span is not None:
            span, offset = open_span
            span.add_event("reactor_dist.first_item", timestamp=wall_ns(at, offset))

    def settled(self, call: CallRecord, end: CallEnd) -> None:
        open_span = self.spans.pop(call, None)
        if open_span is None:
            return
        span, offset = open_span
        compute, times = end.compute, end.times
        span.set_attribute("reactor_dist.outcome", end.outcome)
        if compute:
            span.set_attribute("reactor_dist.rank_compute_seconds", list(compute))
            span.set_attribute("reactor_dist.slowest_rank",
                               max(range(len(compute)), key=compute.__getitem__))
        ended = wall_ns(times[3] if times is not None else time.perf_counter(), offset)
        if end.error is not None:
            failed(span, end.error, ended)
        span.end(end_time=ended)

    def lifecycle(self, name: str, began: float, ended: float,
                  error: BaseException | None) -> None:
        offset = clock_offset_ns()  # read now: a start() or restart() may take minutes
        span = self.tracer.start_span(
            f"reactor_dist.{name}", start_time=wall_ns(began, offset),
            attributes={"reactor_dist.world_size": self.world_size,
                        "reactor_dist.outcome": "ok" if error is None else "failed"})
        if error is not None:
            failed(span, error, wall_ns(ended, offset))
        span.end(end_time=wall_ns(ended, offset))


def wall_ns(perf_seconds: float, offset_ns: int) -> int:
    return int(perf_seconds * 1e9) + offset_ns


def failed(span: Any, error: BaseException, at: int) -> None:
    """The error on the span: ``error.type``, an exception event, status ERROR."""
    kind = type(error)
    span.set_attribute("error.type", kind.__qualname__ if kind.__module__ == "builtins"
                       else f"{kind.__module__}.{kind.__qualname__}")
    span.record_exception(error, timestamp=at)
    span.set_status(Status(StatusCode.ERROR, f"{kind.__name__}: {error}"))


def instrument(runner: DistributedRunner,
               tracer_provider: trace.TracerProvider | None = None) -> TracingObserver:
    """Trace ``runner``'s calls with ``tracer_provider`` (default: the global one);
    once per runner (a second call returns the observer already attached)."""
    observer = _attached.get(runner)
    if observer is None:
        observer = _attached[runner] = TracingObserver(runner.world_size, tracer_provider)
        runner.attach_observer(observer)
    return observer


def uninstrument(runner: DistributedRunner) -> None:
    """Stop tracing ``runner``'s calls (also: start() will not trace it by itself)."""
    observer, _attached[runner] = _attached.get(runner), None
    if observer is not None:
        runner.detach_observer(observer)


def instrument_if_configured(runner: DistributedRunner) -> None:
    """``start()``'s trigger: trace when the application set a tracer provider."""
    if runner not in _attached and configured():
        instrument(runner)
