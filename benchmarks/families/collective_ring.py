"""What the collective rings cost (:mod:`reactor_dist.shm.collective_ring`, issue 45): a
2-rank runner with its gloo group whose ``generate`` makes two ``all_reduce`` calls,
each rank recording them in its ring or not (the ring set aside for the call), timed in
pairs of one call each, in an order drawn per pair, in the same run.  Target: ≤ 2 % of
the call, the median of the pairs' differences.

Two calls: one whose collectives each move a layer's activations (1 MB), and the worst
case, one float each, where the call is nothing but the collectives' latency.  There the
ring's few µs of Python cost several times their warm time: each entry runs right after
a wait, with the rank's caches and TLB cold (docs/design/observability-and-placement.md,
"Each rank's collectives: the ring")."""

from __future__ import annotations

from benchmarks.config import Settings
from benchmarks.report.results import Results, Row
from benchmarks.report.stats import median_pair_difference, on_and_off
from reactor_dist import DistributedWorker

WORLD_SIZE = 2
TARGET = 0.02  # of a call with two collectives
METRIC = "collective ring"
ON, OFF = "ring", "no ring"


class TwoAllReduces(DistributedWorker):
    """Two all_reduce calls of ``NUMEL`` float32 per call, recorded in the ring
    (``generate(True)``) or not (``generate(False)``: the ring set aside meanwhile)."""

    NUMEL = 1

    def load(self) -> None:
        import torch

        self.tensor = torch.ones(self.NUMEL)

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


class TwoLayerAllReduces(TwoAllReduces):
    """The same with 1 MB each: 256 tokens of a 1024-wide layer's activations."""

    NUMEL = 256 * 1024


CASES = (  # config, worker, what its row says
    ("1 MB", TwoLayerAllReduces, "two all_reduce of 1 MB float32 (a layer's activations)"),
    ("1 float", TwoAllReduces, "two all_reduce of one float (the worst case: latency only)"),
)


def measure(settings: Settings, results: Results) -> None:
    for config, worker, _ in CASES:
        # in pairs of one call: a gloo all_reduce of 1 MB keeps one of two speeds here
        # (2 or 4 ms) for hundreds of calls, which blocks fold into the difference
        for key, stats in on_and_off(worker, WORLD_SIZE, ON, OFF, calls=settings.aio_calls,
                                     warmup=settings.aio_warmup).items():
            results.put(METRIC, f"ws{WORLD_SIZE} {config}", key, stats)


def rows(results: Results, settings: Settings) -> list[Row]:
    out = []
    goal = f"≤ +{TARGET:.0%} of the call"
    for config, _, case in CASES:
        cfg = f"ws{WORLD_SIZE} {config}"
        on, off = results.get(METRIC, cfg, ON), results.get(METRIC, cfg, OFF)
        row = Row(section=f"Collective rings (world_size {WORLD_SIZE}, gloo)",
                  case=f"generate() with {case}, each recorded in the rank's ring",
                  unit="us", ours=on, floor=off, floor_label="the same call, the ring set aside",
                  target=goal)
        if on is not None and off is not None:
            extra = median_pair_difference(on, off)
            share = extra / off.median
            row.target = f"{goal} ({share:+.1%}, {extra * 1e6:+.1f} µs, the median pair)"
            row.met = share <= TARGET
        out.append(row)
    return out
