"""Workers for the GPU-marked tests (tests/test_gpu.py): each puts CUDA to work in load()."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from reactor_dist import DistributedWorker

FRAME = 1 << 20  # bytes of the frame filled from the device


class OnGpu(DistributedWorker):
    """``generate(what)`` runs one named check on the rank's GPU; rank 0's answer returns.
    ``slow``: the rank that queues ``spin_cycles`` of GPU work for "slow"."""

    def load(self, slow: int | None = None, spin_cycles: int = 0) -> None:
        import torch

        self.torch, self.slow, self.spin = torch, slow, spin_cycles
        self.ones = torch.ones(4, device=self.device)  # CUDA initialised from load() on

    def generate(self, what: str, /):
        torch = self.torch
        import torch.distributed as dist

        if what == "formed":  # before any collective: NCCL bound and connected in start()
            group = dist.distributed_c10d._get_default_group()
            nccl = group._get_backend(torch.device(self.device))
            return str(group.bound_device_id), bool(nccl._is_initialized())
        if what == "devices":  # every rank's GPU index, all_gathered over NCCL
            mine = torch.tensor([torch.cuda.current_device()], device=self.device)
            parts = [torch.empty_like(mine) for _ in range(self.world_size)]
            dist.all_gather(parts, mine)
            return [int(p.item()) for p in parts]
        if what == "cpu_all_gather":  # the Quickstart's case: CPU tensors on a CUDA rank
            parts = [torch.zeros(1) for _ in range(self.world_size)]
            dist.all_gather(parts, torch.full((1,), float(self.rank)))
            return torch.cat(parts).tolist()
        if what == "frame":  # shared_empty filled from the device
            out = self.shared_empty((FRAME,), np.uint8)
            torch.from_numpy(out).copy_(torch.full((FRAME,), 7, dtype=torch.uint8,
                                                    device=self.device))
            return out
        if what == "frame_pinned":  # is a shared_empty buffer page-locked on this rank?
            return bool(torch.from_numpy(self.shared_empty((FRAME,), np.uint8)).is_pinned())
        if what == "cuda_tensor":
            return torch.arange(6, device=self.device) * (self.rank + 1)
        if what == "slow":  # GPU work queued, not waited for, on the slow rank
            if self.rank == self.slow:
                torch.cuda._sleep(self.spin)
            return float(self.ones.sum().item()) if self.rank == 0 else None
        if what == "out_of_bounds":  # a kernel reads past its tensor: a sticky error
            if self.rank == self.world_size - 1:
                x = torch.zeros(4, device=self.device)
                x[torch.tensor([1 << 20], device=self.device)].sum().item()
            return "returned"
        raise ValueError(f"unknown check {what!r}")


class WeightsOnGpu(DistributedWorker):
    """A model of one CUDA tensor of weights, loaded once per process (a spare too) and
    kept through ``rejoin()``.  ``generate("where")``: (pid, device, the current CUDA
    device, CUDA_VISIBLE_DEVICES, loads, rejoins); ``generate(x)``: the weights' sum
    times ``x``, computed on the GPU (exact in float32 for small ``x``)."""

    def load(self) -> None:
        import torch

        self.weights = torch.arange(1024, device=self.device, dtype=torch.float32)
        self.loads, self.rejoins = 1, 0

    def rejoin(self) -> None:
        self.rejoins += 1

    def generate(self, x, /):
        import os

        import torch

        if x == "where":
            return (os.getpid(), self.device, torch.cuda.current_device(),
                    os.environ.get("CUDA_VISIBLE_DEVICES"), self.loads, self.rejoins)
        return float((self.weights * x).sum().item())

    def reset(self) -> None:
        pass


# -- CUDA tensors in rank 0's result (issue 43): staged into registered shared memory -------
ELEMENTS = 3 << 20  # elements of each tensor below: above staging's threshold (1 MiB)
KINDS = ("uint8", "dataclass", "bf16", "float8_e4m3fn", "bool", "transposed", "small")


@dataclass
class Held:
    """A result that holds its tensor, as a product's result object does."""

    frames: Any


def made(kind: str, device: str) -> Any:
    """The result of ``kind``, the same on every device: integer values, exact in every
    dtype here (bf16 holds -100..99, float8_e4m3fn -8..7 exactly)."""
    import torch

    base = torch.arange(ELEMENTS, device=device)
    if kind in ("uint8", "dataclass"):
        frames = (base % 251).to(torch.uint8).view(3, 1024, 1024)
        return Held(frames) if kind == "dataclass" else frames
    if kind == "bf16":
        return (base % 200 - 100).to(torch.bfloat16).view(1536, 2048)
    if kind == "float8_e4m3fn":
        return (base % 16 - 8).to(torch.float32).to(torch.float8_e4m3fn).view(3072, 1024)
    if kind == "bool":
        return (base % 3 == 0).view(3072, 1024)
    if kind == "transposed":  # a non-contiguous view
        return (base % 241).to(torch.uint8).view(1024, 3072).t()
    if kind == "small":  # under the threshold: the .cpu() path
        return torch.arange(6, device=device)
    raise ValueError(f"unknown kind {kind!r}")


class Tensors(DistributedWorker):
    """``generate(kind)``: ``made(kind)`` on this rank's GPU.  ``generate(x)`` with an
    input array: ``self.to_device(x)``, whether it equals the plain copy
    ``torch.from_numpy(x).to(device)``, and where it is."""

    def generate(self, what, /):
        import torch

        if isinstance(what, np.ndarray):
            on_gpu = self.to_device(what)
            plain = torch.from_numpy(what).to(self.device)
            return on_gpu, bool(torch.equal(on_gpu, plain)), str(on_gpu.device)
        return made(what, self.device)


class StreamsTensors(Tensors):
    """``generate(kinds)`` yields ``made(kind)`` for each kind, one item each."""

    def generate(self, kinds, /):
        for kind in kinds:
            yield made(kind, self.device)
