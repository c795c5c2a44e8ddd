"""A real Prometheus server (Debian's ``prometheus``, installed by ``make prometheus``)
scrapes ``reactor_dist.metrics.serve()`` on 127.0.0.1 every second while a runner makes
calls; its HTTP API answers the call counts and the p99 step time that the runner's own
histogram gives, and every query of docs/grafana/reactor_dist.json returns data."""

from __future__ import annotations

import math
import os
import time

import pytest

pytest.importorskip("prometheus_client")
from metrics_workers import Metered  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402

from benchmarks.metrics_dashboard import (  # noqa: E402
    PrometheusServer,
    dashboard_panels,
    prometheus_binary,
    workload,
)
from reactor_dist import DistributedRunner, metrics  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def histogram_quantile(q: float, buckets: list[tuple[str, float]]) -> float:
    """Prometheus's histogram_quantile over cumulative (le, count) pairs."""
    bounds = [(float(le), n) for le, n in buckets]
    rank = q * bounds[-1][1]
    previous_bound, previous_count = 0.0, 0.0
    for bound, count in bounds:
        if count >= rank:
            if math.isinf(bound):
                return previous_bound
            return previous_bound + (bound - previous_bound) * (
                (rank - previous_count) / (count - previous_count))
        previous_bound, previous_count = bound, count
    raise AssertionError("unreachable")


@pytest.fixture
def prometheus() -> str:
    binary = prometheus_binary()
    if binary is None:
        pytest.skip("no prometheus binary on PATH and `make prometheus` could not install "
                    "Debian's package (apt-get needs root and the Debian mirror)")
    return binary


def test_a_real_prometheus_scrapes_the_runner_and_answers_every_dashboard_query(prometheus):
    registry = CollectorRegistry()
    with DistributedRunner(Metered, world_size=2, device="cpu",
                           init_process_group=False) as runner:
        handle = metrics.register(runner, registry, name="served")
        http = metrics.serve(0, registry=registry)
        try:
            assert http.server_address[0] == "127.0.0.1"
            with PrometheusServer(f"127.0.0.1:{http.server_port}", prometheus) as server:
                data_dir = server.data
                assert f"127.0.0.1:{server.port}" in server.url
                ok = 'reactor_dist_calls_total{runner="served",method="generate",outcome="ok"}'
                # A scrape before any call: every series starts from 0 inside the window.
                server.wait_for(ok, 0)
                began = time.monotonic()
                workload(runner, 6.0)
                # The runner's own view gives the expected values.
                own = {family.name: family for _, family in handle.families()}
                calls = {(s.labels["method"], s.labels["outcome"]): s.value
                         for s in own["reactor_dist_calls"].samples}
                buckets = [(s.labels["le"], s.value)
                           for s in own["reactor_dist_call_duration_seconds"].samples
                           if s.name.endswith("_bucket") and s.labels["method"] == "generate"]
                # About 180 calls in the 6 s on an idle machine; the first raise is the 25th,
                # 7x under that (the time is workload()'s: no wall-clock value here).
                assert calls["generate", "ok"] > 20 and calls["generate", "raised"] >= 1

                # Both counters at the runner's final values in one scrape: a scrape between
                # the last ok call and a raised call after it has the one and not the other.
                server.wait_for(ok, calls["generate", "ok"])
                at = server.wait_for(ok.replace('"ok"', '"raised"'), calls["generate", "raised"])
                raised = server.query(
                    'reactor_dist_calls_total{method="generate",outcome="raised"}', at)
                assert [float(r["value"][1]) for r in raised] == [calls["generate", "raised"]]
                assert [float(r["value"][1]) for r in server.query(ok, at)] == [
                    calls["generate", "ok"]]
                # wall-clock: the 6 s workload, then a scrape (one a second) or two: about 8 s
                # by design, 25 s is 3x that, and the 30 s window of the queries below holds it
                assert time.monotonic() - began < 25, "the 30 s window must hold every call"
                p99 = server.query(
                    "histogram_quantile(0.99, rate(reactor_dist_call_duration_seconds_bucket"
                    '{method="generate"}[30s]))', at)
                assert len(p99) == 1 and p99[0]["metric"]["runner"] == "served"
                assert float(p99[0]["value"][1]) == pytest.approx(
                    histogram_quantile(0.99, buckets), rel=1e-6)

                panels = dashboard_panels(rate_interval="30s")
                assert [title for title, _ in panels] == [
                    "Call rate by outcome", "Step time p50 / p99", "Per-rank compute p50",
                    "Stream first item p50", "Healthy", "Restarts and rank deaths"]
                for title, targets in panels:
                    for expr, _ in targets:
                        result = server.query(expr, at)
                        values = [float(r["value"][1]) for r in result]
                        assert values and all(math.isfinite(v) for v in values), \
                            (title, expr, result)
        finally:
            http.shutdown()
            http.server_close()
            metrics.unregister(handle)
    assert server.proc is None and not os.path.exists(data_dir)
