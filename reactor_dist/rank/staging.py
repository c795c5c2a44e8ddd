"""Bytes between a rank's GPU and shared memory at the hardware's speed, both ways.

**Results out** (:class:`ResultStaging`, rank 0).  A CUDA tensor in a result or a
yielded item would otherwise cross as its ``.detach().cpu()`` copy: a buffer torch
allocates afresh on every call (about 24,000 first-touch page faults for 97 MB), filled
at a third of the bandwidth of page-locked memory, then copied a second time into a
pool segment.  Here it is copied once, ``non_blocking`` on a stream of the rank's own,
into a segment of rank 0's result pool that :mod:`reactor_dist.rank.host_pinning` registered
with CUDA; the pickle refers to that segment where it lies (``transfer.encode`` finds
it, as it finds a ``shared_empty`` array), and :meth:`ResultStaging.wait` waits for
the copies before the message leaves::

    worker returns {"frames": <cuda tensor>}
      pickler meets the tensor  -> a registered result segment, the D2H copy queued
      encode                    -> the segment referenced where it lies, no copy
      wait()                    -> the stream synchronised; then the REPLY (or ITEM)
      caller                    -> a CPU tensor of the same dtype and shape over it

Tensors under :data:`STAGE_FROM` bytes stay on the old path (``.cpu()``): a segment of
its own costs more than their copy.  A non-contiguous tensor is made contiguous on its
GPU first; where the GPU has no room for that, it too takes the old path.

**Inputs in** (:class:`InputStaging`, every rank).  An input array lies in a rank's
private copy-on-write mapping of the runner's segment (:class:`~reactor_dist.shm.segments.
PrivateView`).  Page-locking that mapping is no good: the kernel would break its pages
out of the page cache (or, on older kernels, pin pages a later write by the worker
no longer sees).  So :meth:`InputStaging.to_device` copies from a second, shared
read-only mapping of the same segment, registered once and kept while the segment is
mapped, after checking that the worker has not written to the array's pages (then it
copies what the worker sees, the slow way).

Test hook: ``REACTOR_DIST_STAGE_CPU=1`` in a rank's environment stages CPU tensors and
CPU inputs through the same functions (a plain copy instead of the CUDA stream), so a
machine without a GPU exercises everything but the CUDA calls themselves.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from ..shm.segments import SharedReadView

log = logging.getLogger("reactor_dist")

STAGE_FROM = 1 << 20  # bytes: a device tensor this big goes straight into a segment
STAGE_CPU_ENV = "REACTOR_DIST_STAGE_CPU"
# A numpy array this big made from a torch tensor, returned by a CUDA rank 0: it tells once
# how to do better (:meth:`ResultStaging.hint`).
HINT_FROM = 8 << 20
# What the H200 of issue 43 measured for 97 MB, for the hint's estimate: `.cpu().numpy()`
# end to end, and a copy into page-locked memory.
PAGEABLE_BYTES_PER_S, PINNED_BYTES_PER_S = 1.1e9, 54e9


def stage_cpu() -> bool:
    """Whether this process stages CPU tensors too (the test hook)."""
    return os.environ.get(STAGE_CPU_ENV, "") not in ("", "0")


class ResultStaging:
    """Rank 0's device tensors copied into registered result segments, one call (or one
    item) at a time.  ``allocate(nbytes)`` gives a uint8 array over a pooled result
    segment, registered with CUDA where it can be (RankMemory.shared_empty)."""

    def __init__(self, allocate: Callable[[int], np.ndarray], cpu_too: bool = False) -> None:
        self.allocate = allocate
        self.cpu_too = cpu_too
        self.streams: dict[Any, Any] = {}  # torch.device -> the copy stream of that GPU
        self.pending: list[tuple[Any, Any]] = []  # (source, target) until wait()
        self.hinted = False
        self.staged = 0  # tensors staged so far (tests read it through a worker)
        self.resolved = 0  # conjugate or negative views made plain before their copy

    def wants(self, tensor: Any) -> bool:
        """Whether ``tensor`` (a torch tensor or storage) is staged rather than copied
        with ``.cpu()``."""
        kind = tensor.device.type
        if kind == "cpu" and not self.cpu_too:
            return False
        if kind not in ("cuda", "cpu"):
            return False
        if getattr(tensor, "is_sparse", False) or getattr(tensor, "is_quantized", False) \
                or getattr(tensor, "is_nested", False):
            return False
        return tensor.nbytes >= STAGE_FROM

    def stage(self, tensor: Any) -> np.ndarray | None:
        """A uint8 array over a result segment that will hold ``tensor``'s bytes (C
        order) once :meth:`wait` returns; None where it takes the old path instead (no
        room on its GPU to make it contiguous).  SharedMemoryExhausted as for any result."""
        import torch

        source = tensor.detach()
        if source.is_conj() or source.is_neg():
            # A conjugate or negative view is a bit on the tensor: an async copy_ on the
            # copy stream applies it to the target before the bytes land (checked on torch
            # 2.11 with CUDA), so the bytes are made plain first, on the current stream.
            source = source.resolve_conj().resolve_neg()
            self.resolved += 1
        if not source.is_contiguous():
            try:
                source = source.contiguous()
            except torch.OutOfMemoryError:
                return None
        raw = self.allocate(source.nbytes)
        target = torch.from_numpy(raw).view(source.dtype).view(source.shape)
        if source.device.type == "cuda":
            stream = self.streams.get(source.device)
            if stream is None:
                stream = self.streams[source.device] = torch.cuda.Stream(source.device)
            stream.wait_stream(torch.cuda.current_stream(source.device))
            with torch.cuda.stream(stream):
                target.copy_(source, non_blocking=True)
            self.pending.append((source, target))  # alive until the copy is done
        else:
            target.copy_(source)
        self.staged += 1
        return raw

    def wait(self) -> None:
        """Every copy queued is done: the message may leave."""
        if not self.pending:
            return
        try:
            for stream in self.streams.values():
                stream.synchronize()
        finally:
            self.pending.clear()

    def look_at(self, array: np.ndarray) -> None:
        """Once per rank 0: a worker returned ``.cpu().numpy()`` of a large tensor (a
        numpy array whose base is a torch tensor) where returning the tensor itself
        would have been staged at the GPU's speed: a log record says so."""
        if self.hinted or array.nbytes < HINT_FROM:
            return
        torch = sys.modules.get("torch")
        if torch is None or not isinstance(array.base, torch.Tensor):
            return
        self.hinted = True
        n = array.nbytes
        log.warning(
            "reactor_dist: rank 0 returned a %.1f MB numpy array made from a torch tensor "
            "(.cpu().numpy()): return the CUDA tensor itself instead (bare or inside your "
            "result) and reactor_dist copies it straight into page-locked shared memory, "
            "the caller getting a CPU tensor (its .numpy() is free); on an H200 that is "
            "~%.1f ms a call instead of ~%.0f ms (docs: Performance, frames from the GPU)",
            n / 1e6, n / PINNED_BYTES_PER_S * 1e3, n / PAGEABLE_BYTES_PER_S * 1e3)


class InputStaging:
    """Every rank's fast path from an input array to its GPU (see the module's text).
    ``views()`` gives the rank's input mappings by name (PrivateView); ``pinning``
    registers with CUDA (a :class:`~reactor_dist.rank.host_pinning.HostPinning`)."""

    def __init__(self, directory: str, views: Callable[[], dict[str, Any]],
                 pinning: Any, device: Callable[[], str],
                 cpu_too: bool = False) -> None:
        self.directory, self.views, self.pinning = directory, views, pinning
        self.device, self.cpu_too = device, cpu_too
        self.dma: dict[str, SharedReadView] = {}
        self.fast = 0  # copies that took the registered mapping (tests read it)
        self.unmappable: set[str] = set()  # input segments whose view failed to map
        self.told = False  # the one log record of a failed mapping

    def to_device(self, x: Any, non_blocking: bool = True) -> Any:
        """``x`` (a numpy array or a CPU tensor) as a tensor on this rank's device."""
        import torch

        device = self.device()
        if isinstance(x, torch.Tensor):
            tensor = x
            address, nbytes = x.data_ptr(), x.nbytes
            contiguous, dtype, shape = x.is_contiguous(), x.dtype, tuple(x.shape)
        elif isinstance(x, np.ndarray):
            tensor = None
            address, nbytes = x.ctypes.data, x.nbytes
            contiguous, shape = x.flags.c_contiguous, x.shape
            dtype = x.dtype
        else:
            raise TypeError(f"to_device() takes a numpy array or a torch tensor, not a "
                            f"{type(x).__name__}")
        if (device.startswith("cuda") or self.cpu_too) and contiguous and \
                nbytes >= STAGE_FROM:
            source = self._registered(address, nbytes, dtype, shape)
            if source is not None:
                self.fast += 1
                if not device.startswith("cuda"):
                    return source.clone()  # the test hook: never hand out the shared view
                return source.to(device, non_blocking=non_blocking)
        if tensor is None:
            tensor = torch.from_numpy(x) if x.flags.writeable else torch.from_numpy(x.copy())
        return tensor.to(device, non_blocking=non_blocking)

    def _registered(self, address: int, nbytes: int, dtype: Any, shape: tuple) -> Any:
        """A tensor over the registered shared mapping holding what the worker sees at
        ``address``; None where there is none (not an input, or the worker wrote there)."""
        import torch

        found = next(((name, view) for name, view in self.views().items()
                      if 0 < view.address <= address
                      and address + nbytes <= view.address + view.size), None)
        if found is None:
            return None
        name, view = found
        offset = address - view.address
        if view.written(offset, nbytes):
            return None
        dma = self.dma.get(name)
        if dma is None:
            if name in self.unmappable:
                return None
            try:
                dma = SharedReadView(self.directory, name)
            except (OSError, ValueError) as exc:  # no room for another mapping, a limit
                self.unmappable.add(name)
                if not self.told:
                    self.told = True
                    log.warning("reactor_dist: the read-only view of input segment %s "
                                "could not be mapped (%s); inputs go to the GPU by the "
                                "plain copy (slower)", name, exc)
                return None
            self.dma[name] = dma
        if dma.name not in self.pinning.registered:  # again at each use: CUDA may be up
            self.pinning.pin(dma, read_only=True)  # now, or the limit have room
        raw = np.frombuffer(dma.buffer, np.uint8)[offset:offset + nbytes]
        if isinstance(dtype, torch.dtype):
            return torch.from_numpy(raw).view(dtype).view(shape)
        return torch.from_numpy(raw.view(dtype).reshape(shape))

    def unmapped(self, name: str) -> None:
        """The rank unmaps input segment ``name``: its registered mapping goes first."""
        self.unmappable.discard(name)
        dma = self.dma.pop(name, None)
        if dma is None:
            return
        if dma.name in self.pinning.registered:
            wait_for_copies()
        self.pinning.unpin(dma)
        dma.close()

    def close(self) -> None:
        for name in list(self.dma):
            self.unmapped(name)


def wait_for_copies() -> None:
    """Copies still queued from a mapping about to be unregistered finish first."""
    cuda = sys.modules.get("torch.cuda")
    if cuda is not None and cuda.is_initialized():
        cuda.synchronize()
