"""reactor_dist.metrics: the exposition, parsed with prometheus-client's own parser, after
a known sequence of calls (ok, raised, a stream, reset, a cancelled async call, a crash, a
restart); two runners in one registry; unregister; a shut-down runner's series gone."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

prometheus_client = pytest.importorskip("prometheus_client")
from metrics_workers import Metered  # noqa: E402
from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from reactor_dist import DistributedRunner, WorkerCrashed, metrics  # noqa: E402
from reactor_dist.caller.observers import OUTCOMES  # noqa: E402


def scrape(registry) -> dict[tuple[str, frozenset], float]:
    """Every sample of the registry's exposition: (name, labels) -> value."""
    text = generate_latest(registry).decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = (s.name, frozenset(s.labels.items()))
            assert key not in samples, f"sample {key} exposed twice"
            samples[key] = s.value
    return samples


def of(samples, name: str, **labels) -> float:
    return samples[name, frozenset({k: str(v) for k, v in labels.items()}.items())]


def names(samples) -> set[str]:
    return {name for name, _ in samples}


def runner(world_size: int = 2) -> DistributedRunner:
    return DistributedRunner(Metered, world_size=world_size, device="cpu",
                             init_process_group=False, call_timeout=30)


def cancel_one_call(r: DistributedRunner) -> None:
    """An agenerate() cancelled while the ranks run it; returns once it is settled."""
    async def main():
        task = asyncio.create_task(r.agenerate({"sleep": 0.5}))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await r.await_idle(30)

    asyncio.run(main())


def test_every_counter_and_histogram_after_a_known_sequence_of_calls():
    registry = CollectorRegistry()
    with runner() as r:
        handle = metrics.register(r, registry)
        assert r.generate(1) == 1  # ok
        with pytest.raises(ValueError, match="asked to raise"):
            r.generate("raise")  # raised
        assert list(r.stream({"stream": 3})) == [0, 1, 2]  # ok, with a first item
        r.reset()  # ok (reset)
        cancel_one_call(r)  # cancelled
        with pytest.raises(WorkerCrashed):
            r.generate("crash")  # crashed; rank 1 died
        s = scrape(registry)
        assert of(s, "reactor_dist_healthy", runner="Metered") == 0
        r.restart()
        assert r.generate({"sleep": 0.3}) == {"sleep": 0.3}  # ok; rank 0 over 0.25 s
        s = scrape(registry)
        metrics.unregister(handle)

    label = {"runner": "Metered"}
    expected_calls = {("generate", "ok"): 3, ("generate", "raised"): 1,
                      ("generate", "cancelled"): 1, ("generate", "crashed"): 1,
                      ("reset", "ok"): 1}
    for method in ("generate", "reset"):
        for outcome in OUTCOMES:
            assert of(s, "reactor_dist_calls_total", method=method, outcome=outcome,
                      **label) == expected_calls.get((method, outcome), 0), (method, outcome)
    # Answered calls have timings: generate ok x3 and raised; reset.  Cancelled and
    # crashed ones were never answered by every rank.
    histograms = {("reactor_dist_call_duration_seconds", (("method", "generate"),)): 4,
                  ("reactor_dist_call_duration_seconds", (("method", "reset"),)): 1,
                  ("reactor_dist_rank_compute_seconds", (("rank", "0"),)): 5,
                  ("reactor_dist_rank_compute_seconds", (("rank", "1"),)): 5,
                  ("reactor_dist_call_overhead_seconds", ()): 5,
                  ("reactor_dist_stream_first_item_seconds", ()): 1}
    for (name, extra), count in histograms.items():
        labels = {**label, **dict(extra)}
        assert of(s, name + "_count", **labels) == count, name
        assert of(s, name + "_bucket", le="+Inf", **labels) == count, name
        bounds = [*metrics.BUCKETS, float("inf")]
        cumulative = [of(s, name + "_bucket", le="+Inf" if b == float("inf") else repr(b),
                         **labels) for b in bounds]
        assert cumulative == sorted(cumulative), name
        assert of(s, name + "_sum", **labels) >= 0  # wall-clock: durations are never negative
    # The 0.3 s step of rank 0 lies above the 0.25 s bound, in its compute and the wall.
    for name, labels in (("reactor_dist_rank_compute_seconds", {"rank": 0}),
                         ("reactor_dist_call_duration_seconds", {"method": "generate"})):
        count = of(s, name + "_count", **label, **labels)
        # wall-clock: lower bounds: a 0.3 s sleep never ends early (load only lengthens it)
        assert of(s, name + "_bucket", le="0.25", **label, **labels) <= count - 1
        assert of(s, name + "_sum", **label, **labels) >= 0.3  # wall-clock: as above
    assert of(s, "reactor_dist_rank_deaths_total", rank=0, **label) == 0
    assert of(s, "reactor_dist_rank_deaths_total", rank=1, **label) == 1
    assert of(s, "reactor_dist_restarts_total", **label) == 1
    assert of(s, "reactor_dist_spare_takeovers_total", **label) == 0  # no spares=
    assert of(s, "reactor_dist_spares_ready", **label) == 0
    assert of(s, "reactor_dist_healthy", **label) == 1
    assert of(s, "reactor_dist_calls_in_flight", **label) == 0
    assert of(s, "reactor_dist_shared_memory_bytes", **label) >= 0
    assert of(s, "reactor_dist_load_seconds", rank=0, **label) >= 0  # wall-clock: never < 0
    assert of(s, "reactor_dist_load_seconds", rank=1, **label) >= 0  # wall-clock: never < 0
    assert of(s, "reactor_dist_info", device="cpu", placement="local", world_size=2,
              **label) == 1
    assert names(s) == {
        "reactor_dist_calls_total",
        *(f"{h}_{part}" for h in ("reactor_dist_call_duration_seconds",
                                  "reactor_dist_rank_compute_seconds",
                                  "reactor_dist_rank_collective_wait_seconds",
                                  "reactor_dist_call_overhead_seconds",
                                  "reactor_dist_stream_first_item_seconds")
          for part in ("bucket", "count", "sum")),
        "reactor_dist_rank_deaths_total", "reactor_dist_restarts_total",
        "reactor_dist_spare_takeovers_total", "reactor_dist_spares_ready",
        "reactor_dist_calls_in_flight", "reactor_dist_healthy",
        "reactor_dist_shared_memory_bytes", "reactor_dist_load_seconds",
        "reactor_dist_info"}


def test_two_runners_in_one_registry_unregister_and_shutdown():
    registry = CollectorRegistry()
    with runner() as a, runner(world_size=1) as b:
        handle_a = metrics.register(a, registry, name="a")
        with pytest.raises(ValueError, match="already registered.*name="):
            metrics.register(b, registry, name="a")
        handle_b = metrics.register(b, registry, name="b")
        handle_b.FOLD_AT = 1  # b's calls are counted in the hook, a's at the scrape
        a.generate(1)
        for i in range(2):
            b.generate(i)
        s = scrape(registry)
        assert of(s, "reactor_dist_calls_total", runner="a", method="generate",
                  outcome="ok") == 1
        assert of(s, "reactor_dist_calls_total", runner="b", method="generate",
                  outcome="ok") == 2
        assert of(s, "reactor_dist_info", runner="b", device="cpu", placement="local",
                  world_size=1) == 1
        assert {dict(labels)["rank"] for name, labels in s
                if name == "reactor_dist_rank_compute_seconds_count"} == {"0", "1"}
        assert {dict(labels)["runner"] for _, labels in s} == {"a", "b"}

        metrics.unregister(handle_a)
        metrics.unregister(handle_a)  # idempotent
        a.generate(2)  # no longer counted anywhere
        s = scrape(registry)
        assert {dict(labels)["runner"] for _, labels in s} == {"b"}
        metrics.register(a, registry, name="a")  # again, from zero
        s = scrape(registry)
        assert of(s, "reactor_dist_calls_total", runner="a", method="generate",
                  outcome="ok") == 0

        b.shutdown()  # its series go
        s = scrape(registry)
        assert {dict(labels)["runner"] for _, labels in s} == {"a"}
    assert scrape(registry) == {}


def test_import_reactor_dist_does_not_import_prometheus_client_and_a_clear_error_without_it():
    code = ("import sys, reactor_dist, reactor_dist.metrics\n"
            "assert 'prometheus_client' not in sys.modules, 'imported'\n"
            "sys.modules['prometheus_client'] = None\n"
            "try:\n"
            "    reactor_dist.metrics.serve(0)\n"
            "except ImportError as e:\n"
            "    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ("reactor_dist.metrics needs prometheus-client: "
                                  "pip install 'reactor-dist[metrics]'")


def test_serve_binds_loopback_and_exposes_the_default_registry():
    import urllib.request

    with runner(world_size=1) as r:
        handle = metrics.register(r, name="served")
        server = metrics.serve(0)
        try:
            assert server.server_address[0] == "127.0.0.1"
            r.generate(1)
            url = f"http://127.0.0.1:{server.server_port}/metrics"
            with urllib.request.urlopen(url, timeout=10) as response:
                text = response.read().decode()
        finally:
            server.shutdown()
            server.server_close()
            metrics.unregister(handle)
    assert ('reactor_dist_calls_total{method="generate",outcome="ok",runner="served"} 1.0'
            in text.splitlines())


def test_each_ranks_collective_wait_is_a_histogram():
    """The usual straggler: rank 1 sleeps 250 ms before an all_reduce, so rank 0 waits
    inside it; without a group (the test above) the series has no observation."""
    from timing_workers import SlowBeforeAllReduce

    registry = CollectorRegistry()
    with DistributedRunner(SlowBeforeAllReduce, world_size=2, device="cpu",
                           load_kwargs={"slow": 1, "extra": 0.25}) as r:
        r.generate(0)  # the first all_reduce forms gloo's pairs: both ranks wait for that
        handle = metrics.register(r, registry, name="s")
        for _ in range(3):
            r.generate(0)
        s = scrape(registry)
        metrics.unregister(handle)
    name = "reactor_dist_rank_collective_wait_seconds"
    for rank in (0, 1):
        assert of(s, name + "_count", runner="s", rank=rank) == 3
    # Rank 0 waited about 250 ms a call for rank 1; rank 1 hardly waited.
    # 0.1 s is 150 ms under the straggle: rank 1 waits only if rank 0 comes to the
    # all_reduce over 150 ms after it (behind a 50 ms straggle, a loaded CI machine once
    # made rank 1 wait over 25 ms).
    assert of(s, name + "_bucket", runner="s", rank=0, le=repr(0.1)) == 0
    assert of(s, name + "_bucket", runner="s", rank=1, le=repr(0.1)) == 3
