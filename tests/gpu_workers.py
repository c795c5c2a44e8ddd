"""Workers for the GPU-marked tests (tests/test_gpu.py): each puts CUDA to work in load()."""

from __future__ import annotations

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
