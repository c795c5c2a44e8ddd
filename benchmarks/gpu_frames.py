"""What `make gpu-check`'s frame timings run on the GPU (benchmarks/gpu_check.py): the
workers, the floors and the rows of issue 43 with their goals.

The table's logic (:func:`frame_rows`) takes measured seconds and needs no GPU, so the CPU
tests check it with given numbers (tests/test_gpu_check.py)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from reactor_dist import DistributedWorker
from reactor_dist.rank.host_pinning import HostPinning
from reactor_dist.shm.segments import DEFAULT_DIR, Segment

SHAPE = (81, 480, 832, 3)  # 97 MB of uint8 RGB frames
NBYTES = int(np.prod(SHAPE))
BF16_SHAPE = (25, 1000, 1000)  # 50 MB of bfloat16: a latent or an activation
BF16_NBYTES = int(np.prod(BF16_SHAPE)) * 2
GOAL = 1.2  # × its floor (issue 43): a row above it fails


@dataclass
class VideoResult:
    """A result as a product's worker returns it: the frames inside an object."""

    frames: Any


class GpuFrames(DistributedWorker):
    """97 MB of uint8 frames and 50 MB of bf16 on the GPU; ``generate(kind)`` returns the
    kind asked for, and an input array is copied to the GPU with ``self.to_device`` (the
    seconds of that copy, timed in the rank, come back)."""

    def load(self) -> None:
        import torch

        self.torch = torch
        self.frames = torch.randint(0, 255, SHAPE, dtype=torch.uint8, device=self.device)
        self.latent = torch.randn(BF16_SHAPE, dtype=torch.bfloat16, device=self.device)

    def result(self, kind: str | None) -> Any:
        if kind == "tensor":
            return self.frames
        if kind == "dataclass":
            return VideoResult(self.frames)
        if kind == "bf16":
            return self.latent
        if kind == "numpy":
            return self.frames.cpu().numpy()
        if kind == "shared":
            out = self.shared_empty(SHAPE, np.uint8)
            self.torch.from_numpy(out).copy_(self.frames)
            return out
        if kind is None:
            return None
        raise ValueError(f"unknown kind {kind!r}")

    def generate(self, what, /):
        if isinstance(what, np.ndarray):  # the input path: the copy to the GPU alone
            self.synchronize()
            began = time.perf_counter()
            on_gpu = self.to_device(what)
            self.synchronize()
            seconds = time.perf_counter() - began
            del on_gpu
            return seconds
        return self.result(what)

    def synchronize(self) -> None:
        """Wait for the GPU's work (nothing to wait for on a CPU rank: the CPU tests)."""
        if self.device.startswith("cuda"):
            self.torch.cuda.synchronize()


class GpuFramesStream(GpuFrames):
    """The same results yielded by a streaming generate, one item per step."""

    def generate(self, what, /):
        yield self.result(what)


# -- the rows ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class FrameRow:
    """One row of the table: what was measured (``key`` in the timings), how many bytes it
    moves, the row whose median is its floor, and its goal (× floor; None: reported)."""

    key: str
    label: str
    nbytes: int = 0
    floor: str | None = None
    goal: float | None = None


D2H, D2H_BF16, H2D = "floor_d2h", "floor_d2h_bf16", "floor_h2d"
ROWS = (
    FrameRow("start", "start() to ready, 1 rank"),
    FrameRow("empty", "empty call"),
    FrameRow(D2H, "floor: D2H of the 97 MB uint8 into pinned memory", NBYTES),
    FrameRow(D2H_BF16, "floor: D2H of the 50 MB bf16 into pinned memory", BF16_NBYTES),
    FrameRow(H2D, "floor: H2D of 97 MB from pinned memory", NBYTES),
    FrameRow("tensor_first", "97 MB uint8 CUDA tensor, first call (registration)", NBYTES,
             D2H),
    FrameRow("tensor", "97 MB uint8 CUDA tensor, steady state", NBYTES, D2H, GOAL),
    FrameRow("dataclass", "a dataclass holding it", NBYTES, D2H, GOAL),
    FrameRow("bf16", "50 MB bf16 CUDA tensor", BF16_NBYTES, D2H_BF16, GOAL),
    FrameRow("stream_tensor", "stream: the 97 MB uint8 tensor, one item", NBYTES, D2H, GOAL),
    FrameRow("stream_dataclass", "stream: the dataclass, one item", NBYTES, D2H, GOAL),
    FrameRow("stream_bf16", "stream: the 50 MB bf16 tensor, one item", BF16_NBYTES,
             D2H_BF16, GOAL),
    FrameRow("numpy", "97 MB returned as .cpu().numpy()", NBYTES, D2H),
    FrameRow("shared", "97 MB through shared_empty, filled from the GPU", NBYTES, D2H),
    FrameRow("to_device", "97 MB input, self.to_device(x) in the worker", NBYTES, H2D, GOAL),
    FrameRow("d2h_plain_shm", "D2H into plain shared memory", NBYTES, D2H),
    FrameRow("d2h_registered_shm", "D2H into registered shared memory", NBYTES, D2H),
)


def described(row: FrameRow, timing: dict) -> str:
    """A row's median (and p90 where there are several trials) and its rate."""
    median, p90 = timing["median"], timing.get("p90")
    if row.key == "start":
        return f"{median:.2f} s"
    text = f"median {median * 1e3:.2f} ms"
    if p90 is not None:
        text += f", p90 {p90 * 1e3:.2f} ms"
    if row.nbytes:
        text += f", {row.nbytes / median / 1e9:.1f} GB/s"
    return text


def frame_rows(timings: dict[str, dict]) -> list[tuple[str, str, bool]]:
    """The table: (label, text, failed) for each row of ROWS, from ``timings`` (key ->
    ``{"median": s, "p90": s}``, or ``{"error": why}``).  A row fails above its goal,
    or when it has a goal and was not measured (nor its floor)."""
    out = []
    for row in ROWS:
        timing = timings.get(row.key)
        if timing is None or "error" in timing:
            why = "not measured" if timing is None else f"error: {timing['error']}"
            out.append((row.label, why, row.goal is not None))
            continue
        text, failed = described(row, timing), False
        floor = timings.get(row.floor or "", {})
        if row.floor is not None and "median" in floor:
            ratio = timing["median"] / floor["median"]
            text += f"; {ratio:.2f}× floor"
            if row.goal is not None:
                failed = ratio > row.goal
                text += f" (goal ≤ {row.goal:g}×): {'FAILED' if failed else 'ok'}"
        elif row.goal is not None:
            text += "; its floor was not measured: FAILED"
            failed = True
        out.append((row.label, text, failed))
    return out


# -- the floors -------------------------------------------------------------------------------
def copies_into_shared_memory(frames, timed) -> dict[str, dict]:
    """One device-to-host copy of ``frames`` into a /dev/shm segment, plain and then
    registered with CUDA the way a rank registers its result segments."""
    import torch

    nbytes = frames.numel()
    seg = Segment.create(DEFAULT_DIR, f"rd-gpu-check-{os.getpid()}", nbytes, "gpu-check")
    pinning = HostPinning(torch.cuda.cudart)
    try:
        host = torch.from_numpy(np.frombuffer(seg.mm, np.uint8)[:nbytes]).view(frames.shape)
        plain = timed(partial(host.copy_, frames))
        registered = (timed(partial(host.copy_, frames)) if pinning.pin(seg)
                      else {"error": "cudaHostRegister failed"})
        del host  # the mapping can close
    finally:
        pinning.unpin(seg)
        seg.close(unlink=True)
    return {"d2h_plain_shm": plain, "d2h_registered_shm": registered}


def floors(timed) -> dict[str, dict]:
    """The hardware floors of the rows, in this process: a copy between the GPU and
    page-locked memory (``pin_memory=True``), non_blocking, waited for."""
    import torch

    frames = torch.randint(0, 255, SHAPE, dtype=torch.uint8, device="cuda")
    latent = torch.randn(BF16_SHAPE, dtype=torch.bfloat16, device="cuda")
    pinned = torch.empty(SHAPE, dtype=torch.uint8, pin_memory=True)
    pinned_bf16 = torch.empty(BF16_SHAPE, dtype=torch.bfloat16, pin_memory=True)
    on_gpu = torch.empty_like(frames)

    def copy(dst, src) -> None:
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()

    return {D2H: timed(partial(copy, pinned, frames)),
            D2H_BF16: timed(partial(copy, pinned_bf16, latent)),
            H2D: timed(partial(copy, on_gpu, pinned)),
            **copies_into_shared_memory(frames, timed)}
