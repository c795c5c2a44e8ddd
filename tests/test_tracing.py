"""OpenTelemetry traces (reactor_dist.tracing), read back from the SDK's in-memory
exporter: each call a span under the caller's span, its attributes, a recorded error,
a stream's first item, start and restart; nothing imported or done without a provider.

The tests in this process give each runner its own TracerProvider (the global one can
be set once per process, and would trace every later test's runners); the global
trigger is tested in a fresh interpreter."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from sample_workers import FAULT, ExitsOnRank
from tracing_workers import Counts

from reactor_dist import WorkerCrashed
from reactor_dist.tracing import instrument, uninstrument

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def in_memory() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def check_ok_call(span, parent, seq: int) -> None:
    """A call that returned: under ``parent``, with its number, compute and slowest rank."""
    assert span.parent is not None and span.parent.span_id == parent.context.span_id
    assert span.context.trace_id == parent.context.trace_id
    attributes = span.attributes
    assert attributes["reactor_dist.world_size"] == 2
    assert attributes["reactor_dist.call"] == seq
    assert attributes["reactor_dist.outcome"] == "ok"
    compute = attributes["reactor_dist.rank_compute_seconds"]
    assert len(compute) == 2 and all(seconds >= 0.0 for seconds in compute)  # wall-clock: >= 0
    assert attributes["reactor_dist.slowest_rank"] == max((0, 1), key=compute.__getitem__)
    assert span.status.status_code == StatusCode.UNSET
    # wall-clock: an order: the span lies inside its parent's, on the one clock
    assert parent.start_time <= span.start_time <= span.end_time <= parent.end_time


def test_each_call_is_a_span_in_the_callers_trace(runner_for):
    provider, exporter = in_memory()
    tracer = provider.get_tracer("the app")
    with runner_for(Counts) as runner:
        observer = instrument(runner, provider)
        # an offset read over a second ago, before the wall clock stepped 50 ms: read again
        observer.offset_ns -= 50_000_000
        observer.offset_read -= 2.0
        with tracer.start_as_current_span("request") as request:
            assert runner.generate(2) == [0, 1]
            runner.reset()
            assert list(runner.stream(3)) == [0, 1, 2]
            with pytest.raises(ValueError) as raised:
                runner.generate(-1)
            assert runner.submit(1).result() == [0]

        async def task():
            with tracer.start_as_current_span("async request"):
                assert await runner.agenerate(1) == [0]
                assert [item async for item in runner.astream(2)] == [0, 1]

        asyncio.run(task())
        uninstrument(runner)
        with tracer.start_as_current_span("untraced"):
            assert runner.generate(1) == [0]  # no span of its own any more
    spans = exporter.get_finished_spans()
    assert [span.name for span in spans] == [
        "reactor_dist.generate", "reactor_dist.reset", "reactor_dist.stream",
        "reactor_dist.generate", "reactor_dist.generate", "request",
        "reactor_dist.generate", "reactor_dist.stream", "async request", "untraced"]
    generate, reset, stream, error, submitted, _, agenerate, astream, arequest, _ = spans
    for seq, span in ((1, generate), (2, reset), (3, stream), (5, submitted)):
        check_ok_call(span, request, seq)
    for seq, span in ((6, agenerate), (7, astream)):
        check_ok_call(span, arequest, seq)

    # The error: every rank raised the same ValueError, the caller got it; so does the span.
    assert error.parent.span_id == request.context.span_id
    assert error.attributes["reactor_dist.call"] == 4
    assert error.attributes["reactor_dist.outcome"] == "raised"
    assert error.attributes["error.type"] == "ValueError"
    assert error.status.status_code == StatusCode.ERROR
    assert error.status.description == f"ValueError: {raised.value}"
    (event,) = [e for e in error.events if e.name == "exception"]
    assert event.attributes["exception.type"] == "ValueError"
    assert event.attributes["exception.message"] == str(raised.value) == "n must be >= 0, got -1"

    # Rank 0's first item: one event, inside the span (a generator's generate() has it too).
    for span in (stream, astream, generate):
        (first,) = [e for e in span.events if e.name == "reactor_dist.first_item"]
        # wall-clock: an order: the event lies inside its span, on the one clock
        assert span.start_time <= first.timestamp <= span.end_time
    assert [e.name for e in reset.events] == []


def test_start_restart_and_a_crash_are_spans(runner_for):
    provider, exporter = in_memory()
    tracer = provider.get_tracer("the app")
    runner = runner_for(ExitsOnRank, load_kwargs={"rank": 1})
    observer = instrument(runner, provider)
    with tracer.start_as_current_span("service up") as up:
        runner.start()
    try:
        with pytest.raises(WorkerCrashed) as crashed:
            runner.generate(FAULT)
        # the wall clock stepped 50 ms forward since the observer read its offset (a VM's
        # clock sync): the restart's span still lies inside its parent's (CI once saw 2 ms)
        observer.offset_ns -= 50_000_000
        with tracer.start_as_current_span("recover") as recover:
            runner.restart()
        assert runner.generate("after") == "after"
    finally:
        runner.shutdown()
    spans = exporter.get_finished_spans()
    assert [span.name for span in spans] == [
        "reactor_dist.start", "service up", "reactor_dist.generate", "reactor_dist.restart",
        "recover", "reactor_dist.generate"]
    start, _, crash, restart, _, after = spans
    for span, parent in ((start, up), (restart, recover)):
        assert span.parent.span_id == parent.context.span_id
        assert span.attributes == {"reactor_dist.world_size": 2, "reactor_dist.outcome": "ok"}
        assert span.status.status_code == StatusCode.UNSET
        # wall-clock: an order: the span lies inside its parent's, on the one clock
        assert parent.start_time <= span.start_time <= span.end_time <= parent.end_time
    assert crash.parent is None  # no span was current: a trace of its own
    assert crash.attributes["reactor_dist.outcome"] == "crashed"
    assert "reactor_dist.rank_compute_seconds" not in crash.attributes  # not every rank replied
    assert crash.attributes["error.type"] == "reactor_dist.errors.WorkerCrashed"
    assert crash.status.status_code == StatusCode.ERROR
    (event,) = [e for e in crash.events if e.name == "exception"]
    assert event.attributes["exception.message"] == str(crashed.value)
    assert after.attributes["reactor_dist.outcome"] == "ok"


FRESH_INTERPRETER = """
import sys
from reactor_dist import DistributedRunner
from sample_workers import Echo

def otel():
    return sorted(m for m in sys.modules if m.split(".")[0] == "opentelemetry")

def runner():
    return DistributedRunner(Echo, world_size=1, init_process_group=False, device="cpu")

if __name__ == "__main__":
    with runner() as plain:
        print(plain.generate("no otel"), otel(), "reactor_dist.tracing" in sys.modules)
    from opentelemetry import trace  # the app uses OpenTelemetry, with no provider yet
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    with runner() as early:  # started before the provider was set: never traced
        exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        trace.set_tracer_provider(provider)
        with trace.get_tracer("app").start_as_current_span("early request"):
            print(early.generate("started before the provider"))
    with trace.get_tracer("app").start_as_current_span("request"):
        with runner() as traced:
            print(traced.generate("provider set"))
    print([(span.name, span.parent is not None) for span in exporter.get_finished_spans()])
"""


def test_traced_once_the_app_set_a_provider_and_nothing_imported_without(tmp_path):
    (tmp_path / "app.py").write_text(textwrap.dedent(FRESH_INTERPRETER))
    out = subprocess.run(
        [sys.executable, "app.py"], cwd=tmp_path, capture_output=True, text=True,
        timeout=120, env=dict(os.environ, PYTHONPATH=os.pathsep.join(
            [os.path.join(REPO, "tests"), REPO])))
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "no otel [] False",
        "started before the provider",
        "provider set",
        "[('early request', False), ('reactor_dist.start', True), "
        "('reactor_dist.generate', True), ('request', False)]",
    ]


def test_docs_traces_example_runs_as_printed(tmp_path):
    from docs_pages import examples, run_block

    (block,) = examples("docs/seeing-inside-a-step.md", "Traces (OpenTelemetry)")
    assert run_block(tmp_path, block).splitlines() == [
        "reactor_dist.start True ok", "reactor_dist.generate True ok", "request False None"]
