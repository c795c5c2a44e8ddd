"""Prometheus metrics for a runner: ``register(runner)``, then ``serve(port)`` (or your own
exposition of the registry).  Needs the optional extra ``reactor-dist[metrics]``
(prometheus-client); ``import reactor_dist`` never imports it.

Why two halves: a call must stay cheap, and a scrape may be slow.  :class:`RunnerMetrics`
is an :class:`~reactor_dist.caller.observers.Observer` whose ``settled()`` hook only appends
the call's tuples to a deque (under the call queue's lock); the scrape
(:meth:`RunnerMetrics.families`) counts them into counters and histogram buckets in one
numpy batch, and builds the metric families from those and from the runner's public
state (``healthy``, ``calls_in_flight``, ...) at that moment.

Every runner registered on one registry is exposed by one collector per registry
(:class:`_RegistryCollector`), so that each family appears once in the exposition with
one series per ``runner`` label (Prometheus rejects a family named twice).  A runner
that was shut down, or garbage-collected, has no series any more.
"""

from __future__ import annotations

import collections
import threading
import weakref
from bisect import bisect_left
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from .caller.observers import OUTCOMES, CallEnd, CallRecord, Observer

if TYPE_CHECKING:
    from .caller.runner import DistributedRunner

PREFIX = "reactor_dist_"
# Upper bounds (seconds) of the histogram buckets: steps from 100 µs to 60 s.
BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
           0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_BOUNDS = np.array(BUCKETS)
METHODS = ("generate", "reset")


def _prometheus() -> Any:
    try:
        import prometheus_client
        import prometheus_client.core
    except ImportError:
        raise ImportError("reactor_dist.metrics needs prometheus-client: "
                          "pip install 'reactor-dist[metrics]'") from None
    return prometheus_client


class Histogram:
    """Bucket counts (not cumulative: one increment per observation) and their sum."""

    __slots__ = ("counts", "sum")

    def __init__(self) -> None:
        self.counts = np.zeros(len(BUCKETS) + 1, dtype=np.int64)  # the last: above 60 s
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(BUCKETS, seconds)] += 1
        self.sum += seconds

    def observe_many(self, seconds: np.ndarray) -> None:
        # side="left" puts a value equal to a bound in that bound's bucket (le: <=).
        where = np.searchsorted(_BOUNDS, seconds, side="left")
        self.counts += np.bincount(where, minlength=len(self.counts))
        self.sum += float(seconds.sum())

    def cumulative(self) -> tuple[list[tuple[str, float]], float]:
        """(le, count) pairs as prometheus-client's HistogramMetricFamily takes them."""
        running, total = np.cumsum(self.counts), self.sum
        les = [repr(bound) for bound in BUCKETS] + ["+Inf"]
        return [(le, int(n)) for le, n in zip(les, running, strict=True)], total


class RunnerMetrics(Observer):
    """The accumulators of one runner (what :func:`register` returns).

    A settled call costs one deque append (its method, outcome, times and compute, tuples
    the queue made anyway); :meth:`fold` turns those into counts at each scrape, or
    in the hook once ``FOLD_AT`` of them wait (so memory stays bounded unscraped)."""

    FOLD_AT = 1024

    def __init__(self, runner: DistributedRunner, name: str) -> None:
        self.name = name
        self.runner_ref = weakref.ref(runner)
        world_size = runner.world_size
        self.pending: collections.deque[tuple] = collections.deque()
        self.folding = threading.Lock()  # one fold at a time (a scrape, or a hook)
        self.calls = {(m, o): 0 for m in METHODS for o in OUTCOMES}
        self.duration = {m: Histogram() for m in METHODS}
        self.overhead = Histogram()
        self.first_item_seconds = Histogram()
        self.deaths = [0] * world_size
        # Per-rank histograms, filled in fold() from settled()'s ``compute`` and the call's
        # collective waits (None without a torch.distributed group: nothing observed).
        self.compute = [Histogram() for _ in range(world_size)]
        self.collective_wait = [Histogram() for _ in range(world_size)]
        self.registry: Any = None  # set by register()

    # -- hooks (under the call queue's lock: add, nothing more) ----------------------------
    def first_item(self, call: CallRecord, at: float) -> None:
        self.first_item_seconds.observe(at - call.started)

    def settled(self, call: CallRecord, end: CallEnd) -> None:
        pending = self.pending
        pending.append((call.method, end.outcome, end.times, end.compute,
                        end.collective_wait))
        if len(pending) >= self.FOLD_AT:
            self.fold(blocking=False)  # a scrape folding now takes these too

    def died(self, ranks: list[int]) -> None:
        for rank in ranks:
            if 0 <= rank < len(self.deaths):
                self.deaths[rank] += 1

    def fold(self, blocking: bool = True) -> None:
        """Count the settled calls not counted yet (in batches: numpy does the buckets)."""
        if not self.folding.acquire(blocking):
            return
        try:
            self._fold()
        finally:
            self.folding.release()

    def _fold(self) -> None:
        """fold() under self.folding."""
        pending = self.pending
        batch = [pending.popleft() for _ in range(len(pending))]
        calls = self.calls
        for key, count in collections.Counter((m, o) for m, o, _, _, _ in batch).items():
            calls[key] = calls.get(key, 0) + count
        waits = [w for _, _, t, c, w in batch if t is not None and c is not None and w]
        if waits:
            array = np.array(waits)
            for rank, hist in enumerate(self.collective_wait):
                hist.observe_many(array[:, rank])
        answered = [(m, t, c) for m, _, t, c, _ in batch if t is not None and c is not None]
        if not answered:
            return
        times = np.array([t for _, t, _ in answered])
        compute = np.array([c for _, _, c in answered])
        wall = times[:, 3] - times[:, 0]
        methods = [m for m, _, _ in answered]
        kinds = set(methods)
        if len(kinds) == 1:  # the usual batch: generate() alone
            self.duration.setdefault(kinds.pop(), Histogram()).observe_many(wall)
        else:
            for method in kinds:
                self.duration.setdefault(method, Histogram()).observe_many(
                    wall[np.fromiter((m == method for m in methods), bool, len(methods))])
        self.overhead.observe_many(wall - compute.max(axis=1))
        for rank, hist in enumerate(self.compute):
            hist.observe_many(compute[:, rank])

    # -- the scrape ------------------------------------------------------------------------
    def families(self) -> list[tuple[str, Any]]:
        """(family name, family) of this runner now; none once it was shut down.  Read
        under the fold lock: a hook that would fold meanwhile leaves it to this scrape."""
        runner = self.runner_ref()
        if runner is None or runner.closed:
            return []
        with self.folding:
            self._fold()
            return list(self._families(runner))

    def _families(self, runner: DistributedRunner) -> Iterator[tuple[str, Any]]:
        pc = _prometheus().core
        name = self.name
        calls = pc.CounterMetricFamily(
            PREFIX + "calls", "Calls answered or failed, by method and outcome.",
            labels=["runner", "method", "outcome"])
        for (method, outcome), count in list(self.calls.items()):
            calls.add_metric([name, method, outcome], count)
        yield calls.name, calls
        duration = pc.HistogramMetricFamily(
            PREFIX + "call_duration_seconds",
            "Wall time of an answered call: send began to result decoded.",
            labels=["runner", "method"])
        for method, hist in self.duration.items():
            duration.add_metric([name, method], *hist.cumulative())
        yield duration.name, duration
        compute = pc.HistogramMetricFamily(
            PREFIX + "rank_compute_seconds", "Seconds each rank spent in its worker method.",
            labels=["runner", "rank"])
        for rank, hist in enumerate(self.compute):
            compute.add_metric([name, str(rank)], *hist.cumulative())
        yield compute.name, compute
        waits = pc.HistogramMetricFamily(
            PREFIX + "rank_collective_wait_seconds",
            "Seconds each rank waited inside torch.distributed collectives during a call "
            "(the others wait for the straggler there).", labels=["runner", "rank"])
        for rank, hist in enumerate(self.collective_wait):
            waits.add_metric([name, str(rank)], *hist.cumulative())
        yield waits.name, waits
        for family, doc, hist in (
                ("call_overhead_seconds",
                 "Wall time of a call less the slowest rank's compute: the runner's cost.",
                 self.overhead),
                ("stream_first_item_seconds",
                 "From sending a call to rank 0's first streamed item.",
                 self.first_item_seconds)):
            single = pc.HistogramMetricFamily(PREFIX + family, doc, labels=["runner"])
            single.add_metric([name], *hist.cumulative())
            yield single.name, single
        deaths = pc.CounterMetricFamily(
            PREFIX + "rank_deaths", "Ranks found dead.", labels=["runner", "rank"])
        for rank, count in enumerate(list(self.deaths)):
            deaths.add_metric([name, str(rank)], count)
        yield deaths.name, deaths
        restarts = pc.CounterMetricFamily(
            PREFIX + "restarts", "Times the ranks were brought back (restart() or "
            "max_restarts).", labels=["runner"])
        restarts.add_metric([name], runner.restarts)
        yield restarts.name, restarts
        takeovers = pc.CounterMetricFamily(
            PREFIX + "spare_takeovers", "Ranks whose place a loaded spare took at a "
            "restart (no load()).", labels=["runner"])
        takeovers.add_metric([name], runner.spare_takeovers)
        yield takeovers.name, takeovers
        for family, doc, value in (
                ("calls_in_flight", "Calls sent and not yet answered by every rank.",
                 runner.calls_in_flight),
                ("healthy", "1 while the runner can take calls, else 0.", int(runner.healthy)),
                ("shared_memory_bytes", "Shared memory this process holds for the runner.",
                 runner.shared_memory_bytes),
                ("spares_ready", "Spares loaded and waiting to take a dead rank's place.",
                 runner.spares_ready)):
            gauge = pc.GaugeMetricFamily(PREFIX + family, doc, labels=["runner"])
            gauge.add_metric([name], value)
            yield gauge.name, gauge
        load = pc.GaugeMetricFamily(PREFIX + "load_seconds", "Seconds of each rank's last "
                                    "load().", labels=["runner", "rank"])
        for rank, seconds in enumerate(runner.load_seconds):
            if seconds is not None:
                load.add_metric([name, str(rank)], seconds)
        yield load.name, load
        devices = runner.devices
        info = pc.InfoMetricFamily("reactor_dist", "What the runner runs on.",
                                   labels=["runner"])
        info.add_metric([name], {
            "world_size": str(runner.world_size),
            "device": ",".join(sorted({d.split(":")[0] for d in devices})) or "none",
            "placement": runner.placement})
        yield info.name, info


class _RegistryCollector:
    """What is registered on a prometheus-client registry: every runner's families,
    merged so that each family appears once."""

    def __init__(self) -> None:
        self.runners: dict[str, RunnerMetrics] = {}

    def describe(self) -> list:
        return []  # no names checked at registration: the runners come and go

    def collect(self) -> Iterator[Any]:
        merged: dict[str, Any] = {}
        for name, metrics in list(self.runners.items()):
            if metrics.runner_ref() is None:  # garbage-collected: nothing to unregister
                with _lock:
                    if self.runners.get(name) is metrics:
                        del self.runners[name]
                continue
            for family_name, family in metrics.families():
                if family_name in merged:
                    merged[family_name].samples.extend(family.samples)
                else:
                    merged[family_name] = family
        yield from merged.values()


_lock = threading.Lock()
_collectors: weakref.WeakKeyDictionary[Any, _RegistryCollector] = weakref.WeakKeyDictionary()


def register(runner: DistributedRunner, registry: Any = None, *,
             name: str | None = None) -> RunnerMetrics:
    """Expose ``runner``'s metrics on ``registry`` (prometheus-client's default registry
    when None), under the label ``runner=name`` (default: the worker class's name).
    Returns the handle that :func:`unregister` takes."""
    pc = _prometheus().core
    registry = pc.REGISTRY if registry is None else registry
    if name is None:
        name = runner.worker_name.rsplit(".", 1)[-1]
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty str (the runner label), got {name!r}")
    metrics = RunnerMetrics(runner, name)
    with _lock:
        collector = _collectors.get(registry)
        if collector is None:
            collector = _collectors[registry] = _RegistryCollector()
            registry.register(collector)
        held = collector.runners.get(name)
        held_runner = held.runner_ref() if held is not None else None
        if held_runner is not None and not held_runner.closed:
            raise ValueError(f"a runner named {name!r} is already registered on this "
                             f"registry; pass name= to tell the runners apart")
        collector.runners[name] = metrics
        metrics.registry = registry
    runner.attach_observer(metrics)
    return metrics


def unregister(metrics: RunnerMetrics) -> None:
    """Remove what :func:`register` added: the runner's series and its observer.
    Idempotent."""
    with _lock:
        registry, metrics.registry = metrics.registry, None
        if registry is None:
            return
        collector = _collectors.get(registry)
        if collector is not None and collector.runners.get(metrics.name) is metrics:
            del collector.runners[metrics.name]
            if not collector.runners:
                registry.unregister(collector)
                del _collectors[registry]
    runner = metrics.runner_ref()
    if runner is not None:
        runner.detach_observer(metrics)


def serve(port: int, addr: str = "127.0.0.1", registry: Any = None) -> Any:
    """Serve ``registry`` (the default one when None) at http://addr:port/metrics from a
    daemon thread, for a process that has no HTTP server of its own.  Loopback unless
    told otherwise.  Returns the server (``server.server_port``: the port, also when
    ``port`` was 0; ``server.shutdown()`` stops it)."""
    pc = _prometheus()
    server, _thread = pc.start_http_server(
        port, addr=addr, registry=pc.REGISTRY if registry is None else registry)
    return server
