"""What `make gpu-check`'s frame timings run on the GPU (benchmarks/gpu_check.py)."""

from __future__ import annotations

import os
from functools import partial

import numpy as np

from reactor_dist import DistributedWorker
from reactor_dist.host_pinning import HostPinning
from reactor_dist.shm import DEFAULT_DIR, Segment

SHAPE = (81, 480, 832, 3)  # 97 MB of uint8 RGB frames


class GpuFrames(DistributedWorker):
    """97 MB of frames on the GPU, returned plain or through ``shared_empty``."""

    def load(self) -> None:
        import torch

        self.torch = torch
        self.frames = torch.randint(0, 255, SHAPE, dtype=torch.uint8, device=self.device)

    def generate(self, how, /):
        if how == "plain":
            return self.frames.cpu().numpy()
        if how == "shared":
            out = self.shared_empty(SHAPE, np.uint8)
            self.torch.from_numpy(out).copy_(self.frames)
            return out
        return None


def copies_into_shared_memory(frames, timed) -> list[tuple[str, tuple[float, float]]]:
    """One device-to-host copy of ``frames`` into a /dev/shm segment, plain and then
    registered with CUDA the way a rank registers its ``shared_empty`` segments."""
    import torch

    nbytes = frames.numel()
    seg = Segment.create(DEFAULT_DIR, f"rd-gpu-check-{os.getpid()}", nbytes, "gpu-check")
    pinning = HostPinning(torch.cuda.cudart)
    try:
        host = torch.from_numpy(np.frombuffer(seg.mm, np.uint8)[:nbytes]).view(frames.shape)
        plain = timed(partial(host.copy_, frames), 20)
        pinning.pin(seg)
        registered = timed(partial(host.copy_, frames), 20)
        state = "registered" if pinning.registered else "registration FAILED, plain"
        del host  # the mapping can close
    finally:
        pinning.unpin(seg)
        seg.close(unlink=True)
    return [("D2H into plain shared memory", plain),
            (f"D2H into {state} shared memory", registered)]
