"""A worker for tests/test_rank_env.py: what a rank's environment and allocator do."""

from __future__ import annotations

import os
import resource

from reactor_dist import DistributedWorker

NBYTES = 81 * 480 * 832 * 3  # 97 MB: what .cpu() of a video step allocates afresh
VARIABLE = "THP_MEM_ALLOC_ENABLE"


class AllocationProbe(DistributedWorker):
    """``generate(None)``: this rank's value of VARIABLE (None when unset) and the page
    faults of one fresh 97 MB torch.empty filled, as ``.cpu()`` would fill it."""

    def generate(self, _, /):
        import torch

        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        buf = torch.empty(NBYTES, dtype=torch.uint8)
        buf.fill_(1)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        del buf
        return os.environ.get(VARIABLE), faults


class EnvOf(DistributedWorker):
    """``call_all("value_of", name)``: each rank's value of the variable ``name``."""

    def generate(self, x, /):
        return x

    def value_of(self, name: str) -> str | None:
        return os.environ.get(name)
