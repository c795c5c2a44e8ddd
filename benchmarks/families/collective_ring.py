"""What the collective rings cost (:mod:`reactor_dist.shm.collective_ring`, issue 45): a
2-rank runner with its gloo group whose ``generate`` makes two ``all_reduce`` calls of
one float, with each rank recording them in its ring or not (the ring set aside for
the call), timed in alternating blocks in the same run.  Target: ≤ 2 % of that call."""

from __future__ import annotations

from benchmarks.config import Settings
from benchmarks.report.results import Results, Row
from benchmarks.report.stats import on_and_off
from reactor_dist import DistributedWorker

WORLD_SIZE = 2
TARGET = 0.02  # of a call with two collectives
METRIC = "collective ring"
ON, OFF = "ring", "no ring"


class TwoAllReduces(DistributedWorker):
    """Two all_reduce calls of one float per call, recorded in the ring
    (``generate(True)``) or not (``generate(False)``: the ring set aside meanwhile)."""

    def load(self) -> None:
        import torch

        self.tensor = torch.ones(1)

    def generate(self, recorded: bool, /) -> None:
        import torch.distributed as dist

        from reactor_dist.rank import collective_wait

        waits = collective_wait._installed  # the rank's own, installed with its group
        assert waits is not None
        ring = waits.ring
        if not recorded:
            waits.ring = None
        try:
            dist.all_reduce(self.tensor)
            dist.all_reduce(self.tensor)
        finally:
            waits.ring = ring


def measure(settings: Settings, results: Results) -> None:
    for key, stats in on_and_off(TwoAllReduces, WORLD_SIZE, ON, OFF, calls=settings.aio_calls,
                                 warmup=settings.aio_warmup, rounds=settings.aio_rounds).items():
        results.put(METRIC, f"ws{WORLD_SIZE}", key, stats)


def rows(results: Results, settings: Settings) -> list[Row]:
    cfg = f"ws{WORLD_SIZE}"
    on, off = results.get(METRIC, cfg, ON), results.get(METRIC, cfg, OFF)
    goal = f"≤ +{TARGET:.0%} of the call"
    row = Row(section=f"Collective rings (world_size {WORLD_SIZE}, gloo)",
              case="generate() with two all_reduce calls, each recorded in the rank's ring",
              unit="us", ours=on, floor=off, floor_label="the same call, the ring set aside",
              target=goal)
    if on is not None and off is not None:
        extra = on.median / off.median - 1
        row.target = f"{goal} ({extra:+.1%}, {(on.median - off.median) * 1e6:+.1f} µs)"
        row.met = extra <= TARGET
    return [row]
