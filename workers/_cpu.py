"""CPU thread budget per rank."""

from __future__ import annotations

import os


def share_cpu_cores(world_size: int, device: str) -> None:
    """On CPU, give each rank its share of the cores instead of all of them.

    torch starts one intra-op thread per core in every process, so N CPU ranks would run
    N times too many threads and fight over the cores (on 2 cores, 2 ranks ran a video
    step ~2.5x slower). ``torchrun`` sets ``OMP_NUM_THREADS=1`` for the same reason; an
    ``OMP_NUM_THREADS`` the user set is respected.
    """
    if device != "cpu" or "OMP_NUM_THREADS" in os.environ:
        return
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(1, (cores or 1) // world_size))
