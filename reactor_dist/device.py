"""Which device a rank computes on: the GPU that is its own, else the CPU."""

from __future__ import annotations

import os
import sys
from typing import Any


def maybe_cuda() -> bool:
    """A cheap guess (no torch import) whether this machine has an NVIDIA driver."""
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/proc/driver/nvidia")


def choose_device(requested: str, rank: int, index: int | None = None) -> str:
    """``requested`` ("auto", "cpu", "cuda") made concrete for ``rank``: its GPU is the
    ``index``-th visible one (Ray shows each rank its own GPU alone: 0), by default
    the ``rank``-th."""
    if requested == "cpu" or (requested == "auto" and not maybe_cuda()):
        return "cpu"
    import torch

    if not torch.cuda.is_available():
        if requested == "cuda":
            raise RuntimeError("device='cuda' was asked for, but torch sees no CUDA device")
        return "cpu"
    count = torch.cuda.device_count()
    gpu = rank if index is None else index
    if gpu >= count:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "<all>")
        raise RuntimeError(
            f"rank {rank} needs a GPU of its own, but only {count} are visible "
            f"(CUDA_VISIBLE_DEVICES={visible}): lower world_size to {count} or pass "
            f"gpus=[...] with one GPU per rank"
        )
    torch.cuda.set_device(gpu)
    return f"cuda:{gpu}"


def cuda_to_wait_for(device: str) -> Any:
    """``torch.cuda`` when a rank's timing must wait for its GPU, else None.

    CUDA kernels run asynchronously: a rank's step returns once they are queued, so its
    timing (and the straggler warning) would blame whichever rank copies to the host.
    Only a CUDA rank whose process has initialised CUDA has anything queued; torch is
    never imported nor CUDA initialised just for this."""
    if not device.startswith("cuda"):
        return None
    cuda = sys.modules.get("torch.cuda")
    return cuda if cuda is not None and cuda.is_initialized() else None


def wait_for_device(device: str) -> None:
    """Wait until the kernels queued on ``device`` are done (see
    :func:`cuda_to_wait_for`); a CUDA error of this step is raised here, in this call."""
    cuda = cuda_to_wait_for(device)
    if cuda is not None:
        cuda.synchronize(device)
