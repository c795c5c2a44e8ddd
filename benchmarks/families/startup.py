"""Start-up: ``start()`` until every rank finished ``load()`` with a worker that
imports torch and forms the process group, next to the same number of bare
``python -c "import torch"`` started in parallel (what the interpreters alone cost)."""

from __future__ import annotations

import time

from benchmarks.config import Settings
from benchmarks.implementations import floors
from benchmarks.implementations.pools import OURS
from benchmarks.report.results import FLOOR, Results, Row
from benchmarks.report.stats import summarize


def start_trial(world_size: int) -> float:
    from benchmarks.implementations.bench_workers import TorchWorker
    from reactor_dist import DistributedRunner

    runner = DistributedRunner(TorchWorker, world_size=world_size, init_process_group=True,
                               start_timeout=300.0)
    try:
        t0 = time.perf_counter()
        runner.start()
        return time.perf_counter() - t0
    finally:
        runner.shutdown()


def measure(settings: Settings, results: Results) -> None:
    s = settings
    for ws in s.startup_world_sizes:
        ours, bare = [], []
        for _ in range(s.startup_trials):  # interleaved, so drift hits both alike
            ours.append(start_trial(ws))
            bare.append(floors.bare_torch_imports(ws))
        results.put("start", f"ws{ws}", OURS, summarize(ours))
        results.put("start", f"ws{ws}", FLOOR, summarize(bare))


def rows(results: Results, settings: Settings) -> list[Row]:
    s = settings
    return [
        Row(section="Start-up (torch worker, torch group)", case=f"start() world_size {ws}",
            unit="s", ours=results.get("start", f"ws{ws}", OURS),
            floor=results.get("start", f"ws{ws}", FLOOR),
            floor_label='as many parallel `python -c "import torch"` as ranks, '
                        'until each has imported it')
        for ws in s.startup_world_sizes
    ]
