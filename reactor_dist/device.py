"""Which device a rank computes on: the GPU that is its own, else the CPU."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any


def maybe_cuda() -> bool:
    """A cheap guess (no torch import) whether this machine has an NVIDIA driver."""
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/proc/driver/nvidia")


def surely_cpu(requested: str) -> bool:
    """Whether ranks asked for ``requested`` compute on the CPU, known without torch:
    "cpu", or "auto" on a machine without an NVIDIA driver."""
    return requested == "cpu" or (requested == "auto" and not maybe_cuda())


def device_kind(requested: str) -> str:
    """``requested`` ("auto", "cpu", "cuda") resolved on this machine to "cpu" or "cuda",
    as every rank resolves it: "auto" is CUDA when torch sees a GPU, else the CPU.
    torch is imported only where an NVIDIA driver is."""
    if surely_cpu(requested):
        return "cpu"
    import torch

    if torch.cuda.is_available():
        return "cuda"
    if requested == "cuda":
        raise RuntimeError("device='cuda' was asked for, but torch sees no CUDA device")
    return "cpu"


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity, which taskset or a container's
    cpuset narrows; every core where the platform has no affinity)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def visible_gpus(gpus: Sequence[int]) -> list[int]:
    """The GPU ids of ``gpus`` once each, in the order first named: what
    CUDA_VISIBLE_DEVICES lists.  A spare may share a rank's GPU (``gpus=[0, 1, 0]``),
    but CUDA takes an id named twice for no GPU at all ("0,0" shows none)."""
    return list(dict.fromkeys(gpus))


def cuda_visible_devices(gpus: Sequence[int]) -> str:
    """CUDA_VISIBLE_DEVICES for ``gpus`` (``gpus=[0, 1, 0]``: "0,1"), the same for
    every rank and spare; each picks its own GPU in it by index (:func:`gpu_index`)."""
    return ",".join(str(g) for g in visible_gpus(gpus))


def gpu_index(gpus: Sequence[int] | None, place: int) -> int:
    """The index, among the visible GPUs, of the GPU of ``place`` (``gpus``' entry: a
    rank's, then a spare's); ``place`` itself where ``gpus`` is not given.
    ``gpus=[0, 1, 0]``: the spare in place 2 uses index 0, GPU 0, as rank 0 does."""
    if gpus is None:
        return place
    return visible_gpus(gpus).index(gpus[place])


def choose_device(requested: str, rank: int, index: int | None = None) -> str:
    """``requested`` ("auto", "cpu", "cuda") made concrete for ``rank``: its GPU is the
    ``index``-th visible one (Ray shows each rank its own GPU alone: 0), by default
    the ``rank``-th."""
    if device_kind(requested) == "cpu":
        return "cpu"
    import torch

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


# The CUDA errors that leave a process's context unusable ("sticky"): after one, every
# later CUDA call of that process fails with it, so the rank's process must be replaced.
# The texts are cudaGetErrorString's (CUDA 12 and 13), which torch puts after "CUDA
# error: " in the AcceleratorError (torch >= 2.8) or RuntimeError (older) it raises.
STICKY_CUDA_ERRORS = (
    "an illegal memory access was encountered",  # cudaErrorIllegalAddress (700)
    "the launch timed out and was terminated",  # cudaErrorLaunchTimeout (702)
    "device-side assert triggered",  # cudaErrorAssert (710)
    "hardware stack error",  # cudaErrorHardwareStackError (714)
    "an illegal instruction was encountered",  # cudaErrorIllegalInstruction (715)
    "misaligned address",  # cudaErrorMisalignedAddress (716)
    "operation not supported on global/shared address space",  # (717)
    "invalid program counter",  # cudaErrorInvalidPc (718)
    "unspecified launch failure",  # cudaErrorLaunchFailure (719)
    "uncorrectable ECC error encountered",  # cudaErrorECCUncorrectable (214)
)


def context_broken(exc: BaseException, device: str) -> bool:
    """Whether ``exc`` (raised on a rank computing on ``device``) left the process's CUDA
    context unusable: it, or an exception it was raised from, names a sticky CUDA error;
    or it is a ``torch.AcceleratorError`` and the GPU no longer synchronises."""
    seen: set[int] = set()
    accelerator = False
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        text = str(error)
        if "CUDA error" in text and any(sticky in text for sticky in STICKY_CUDA_ERRORS):
            return True
        accelerator = accelerator or type(error).__name__ == "AcceleratorError"
        error = error.__cause__ or error.__context__
    if not accelerator or not device.startswith("cuda"):
        return False
    cuda = sys.modules.get("torch.cuda")
    if cuda is None or not cuda.is_initialized():
        return False
    try:  # a sticky error is raised again by any CUDA call; a passing one is not
        cuda.synchronize(device)
    except Exception:
        return True
    return False
