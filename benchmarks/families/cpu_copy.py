"""A fresh 97 MB CPU buffer per call, what ``tensor.cpu()`` allocates (issue 43, item 5):
``torch.empty(n, uint8).copy_(src)`` under each allocator setting of
:mod:`benchmarks.cpu_copy_settings` (each in a fresh process, alternating blocks), next
to its floor, the same copy into a buffer reused from call to call.  Then the same
allocation timed inside a rank (world_size 1): the ranks' default environment
(``THP_MEM_ALLOC_ENABLE=1``, reactor_dist/placement/rank_env.py) against a runner whose
``env=`` turns it off, in alternating blocks.  Target: the default ≤ ``GOAL`` × no
setting, with its resident memory not growing from the first block to the last.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from benchmarks import cpu_copy_settings as settings_bench
from benchmarks.config import Settings
from benchmarks.report.results import Results, Row
from benchmarks.report.stats import alternate_blocks, summarize
from reactor_dist import DistributedWorker

METRIC = "cpu copy"
GOAL = 0.8  # a default must pay clearly, not within the noise
DEFAULT, HUGE, HEAP = settings_bench.SETTINGS  # their names, in order
IN_RANK, IN_RANK_OFF = "in a rank, its default environment", "in a rank, THP off"
# Kept as Stats: RSS after the warm-up, the first block and the last; faults per call.
RSS, FAULTS = "rss", "faults"
GROWTH_SLACK = 4 << 20  # bytes of RSS growth still counted as bounded (allocator noise)


class FreshBuffer(DistributedWorker):
    """``generate(None)``: the seconds of one fresh 97 MB ``torch.empty`` + ``copy_``."""

    def load(self) -> None:
        import torch

        self.torch = torch
        self.src = torch.ones(settings_bench.NBYTES, dtype=torch.uint8)

    def generate(self, _, /) -> float:
        began = time.perf_counter()
        out = self.torch.empty(settings_bench.NBYTES, dtype=self.torch.uint8).copy_(self.src)
        seconds = time.perf_counter() - began
        del out
        return seconds


def in_ranks(calls: int, rounds: int) -> dict[str, list[float]]:
    from reactor_dist import DistributedRunner

    runners = {IN_RANK: DistributedRunner(FreshBuffer, world_size=1, device="cpu"),
               IN_RANK_OFF: DistributedRunner(FreshBuffer, world_size=1, device="cpu",
                                              env={"THP_MEM_ALLOC_ENABLE": "0"})}
    try:
        for runner in runners.values():
            runner.start()

        def block(runner) -> Callable[[int, list[float]], None]:
            return lambda n, into: into.extend(runner.generate(None) for _ in range(n))

        return alternate_blocks({k: block(r) for k, r in runners.items()}, calls=calls,
                                warmup=3, rounds=rounds)
    finally:
        for runner in runners.values():
            runner.shutdown()


def measure(settings: Settings, results: Results) -> None:
    calls, rounds = settings.cpu_copy_calls, settings.cpu_copy_rounds
    for name, m in settings_bench.measure(calls, rounds).items():
        results.put(METRIC, name, "seconds", summarize(m.seconds))
        results.put(METRIC, name, RSS, summarize([m.rss_warm, m.rss_first, m.rss_last]))
        results.put(METRIC, name, FAULTS, summarize([m.faults_per_call]))
    for name, seconds in in_ranks(calls // 2, rounds).items():
        results.put(METRIC, name, "seconds", summarize(seconds))


def rows(results: Results, settings: Settings) -> list[Row]:
    section = ("A fresh 97 MB CPU buffer per call, what .cpu() allocates (torch.empty + "
               "copy_; each setting in a fresh process, alternating blocks; floor: the copy "
               "into a reused buffer)")
    floor = results.get(METRIC, settings_bench.FLOOR, "seconds")
    label = "the same copy into a buffer reused from call to call"
    out = []

    def vs(name: str, than: str, judged: bool, what: str) -> Row:
        ours, base = results.get(METRIC, name, "seconds"), results.get(METRIC, than, "seconds")
        row = Row(section=section, case=what, unit="ms", ours=ours, floor=floor,
                  floor_label=label)
        if ours is None or base is None:
            return row
        ratio = ours.median / base.median
        info = [f"{ratio:.2f} × {than}"]
        grown = 0
        if (rss := results.get(METRIC, name, RSS)) is not None:
            warm, first, last = (int(b) >> 20 for b in rss.samples)
            grown = rss.samples[2] - rss.samples[1]
            info.append(f"RSS {warm}→{first}→{last} MB")
        if (faults := results.get(METRIC, name, FAULTS)) is not None:
            info.append(f"{faults.median:,.0f} faults/call")
        if judged:
            row.target = f"≤ {GOAL} × {than}, RSS bounded ({', '.join(info)})"
            row.met = ratio <= GOAL and grown <= GROWTH_SLACK
        else:
            row.target = f"(info: {', '.join(info)})"
        return row

    out.append(vs(DEFAULT, DEFAULT, False, "no setting (torch's and glibc's defaults)"))
    out.append(vs(HUGE, DEFAULT, True, "THP_MEM_ALLOC_ENABLE=1 (the ranks' default)"))
    out.append(vs(HEAP, DEFAULT, False, "MALLOC_MMAP_MAX_=0, MALLOC_TRIM_THRESHOLD_=1 TiB"))
    out.append(vs(IN_RANK, IN_RANK_OFF, True, "in a rank (world_size 1), its default "
                  "environment"))
    out.append(vs(IN_RANK_OFF, IN_RANK_OFF, False, "in a rank, env={'THP_MEM_ALLOC_ENABLE': "
                  "'0'}"))
    return out
