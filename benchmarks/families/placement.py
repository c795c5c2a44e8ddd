"""Ranks placed by Ray (``placement="ray"``) against the local path, in the same run.

A simulated two-node Ray cluster on this machine (``ray.cluster_utils.Cluster``, every
node on 127.0.0.1, no dashboard, no usage reports): rank 0 on the caller's node, rank 1
on the other (``STRICT_SPREAD``), so rank 1 hears every command over the runner's TCP bus
(CurveZMQ) and gets its input in-band.  Against it, a local runner of the same worker
(``BenchWorker``, world_size 2), timed in alternating blocks:

- ``generate(1)``: the per-call overhead;
- a 16 MB input to both ranks (each returns None): over TCP to rank 1, against
  /dev/shm locally;
- ``start()`` once each (ours: reserve the placement group, start the hosts, the ranks).

No target: the rows show what a rank on another node costs.
"""

from __future__ import annotations

import os
import time

import numpy as np

from benchmarks.config import Settings
from benchmarks.families.overhead import INPUT
from benchmarks.report.results import Results, Row
from benchmarks.report.stats import alternate_blocks, record_calls, summarize

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # every node on 127.0.0.1
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
METRIC = "placement"
LOCAL, RAY = "local", "ray"
INPUT_BYTES = 16_000_000
SECTION = "Ray placement (simulated 2-node cluster on loopback, world_size 2)"


def _runner(placement: str):
    from benchmarks.implementations.bench_workers import BenchWorker
    from reactor_dist import DistributedRunner

    options = {"placement": "ray", "ray_strategy": "STRICT_SPREAD"} if placement == RAY else {}
    return DistributedRunner(BenchWorker, world_size=2, init_process_group=False,
                             device="cpu", call_timeout=120.0, start_timeout=120.0, **options)


def measure(settings: Settings, results: Results) -> None:
    s = settings
    try:
        import ray
        from ray.cluster_utils import Cluster
    except ImportError:
        results.notes.append("placement: Ray is not installed (pip install 'reactor-dist[ray]')")
        return
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 2,
                                                          "include_dashboard": False})
    runners = {}
    try:
        nodes.add_node(num_cpus=2)
        ray.init(address=nodes.address, include_dashboard=False, log_to_driver=False)
        nodes.wait_for_nodes()
        for placement in (LOCAL, RAY):
            runner = runners[placement] = _runner(placement)
            began = time.perf_counter()
            runner.start()
            results.put(METRIC, "start", placement, summarize([time.perf_counter() - began]))
        data = np.full(INPUT_BYTES, 3, np.uint8)
        for runner in runners.values():
            if runner.generate(INPUT) != INPUT or runner.generate(data) is not None:
                raise RuntimeError("the bench worker gave a wrong answer")
        calls = alternate_blocks(
            {p: lambda n, into, r=r: record_calls(lambda: r.generate(INPUT), n, into)
             for p, r in runners.items()},
            calls=s.call_iters, warmup=s.call_warmup, rounds=s.call_rounds)
        inputs = alternate_blocks(
            {p: lambda n, into, r=r: record_calls(lambda: r.generate(data), n, into)
             for p, r in runners.items()},
            calls=s.transfer_iters[0], warmup=s.transfer_warmup, rounds=s.transfer_rounds)
    finally:
        for runner in runners.values():
            runner.shutdown()
        ray.shutdown()
        nodes.shutdown()
    for placement in (LOCAL, RAY):
        results.put(METRIC, "call", placement, summarize(calls[placement]))
        results.put(METRIC, "input", placement, summarize(inputs[placement]))


def rows(results: Results, settings: Settings) -> list[Row]:
    cases = (("call", "us", "generate(1), rank 1 on the other node (TCP, CurveZMQ)"),
             ("input", "ms", "16 MB input to both ranks, rank 1's over TCP"),
             ("start", "s", "start(): placement group, hosts, ranks"))
    return [Row(section=SECTION, case=case, unit=unit, ours=results.get(METRIC, key, RAY),
                floor=results.get(METRIC, key, LOCAL),
                floor_label="placement='local', same worker, same run")
            for key, unit, case in cases]
