"""A worker for the NUMA launcher's test: each rank's CPU affinity."""

from __future__ import annotations

import os

from reactor_dist import DistributedWorker


class CpuAffinity(DistributedWorker):
    """generate() returns every rank's CPUs (all_gather_object, rank order)."""

    def generate(self, _, /):
        import torch.distributed as dist

        every: list = [None] * self.world_size
        dist.all_gather_object(every, sorted(os.sched_getaffinity(0)))
        return every
