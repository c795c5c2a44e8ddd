"""A rank's seconds waiting in ``torch.distributed`` collectives during one call.

Why: a rank that is slow *before* a collective makes the others wait inside it, so every
rank's compute (:mod:`reactor_dist.timings`) comes out the same and the straggler is
invisible.  Each rank therefore also measures its time inside the collectives; its
**busy** time (compute minus that wait) is what differs, and the rank the others wait
for is the one with the most of it.

How: once the rank's group is formed, :func:`install` replaces the collective functions
of the ``torch.distributed`` namespace (:data:`COLLECTIVES`, those that exist) with
timed wrappers, before the worker's module is imported (so ``from torch.distributed
import all_reduce`` gets the wrapper too).  A collective on CPU tensors (gloo) or with
no tensor (``barrier``) blocks the host: its wall time is the wait.  A collective on
CUDA tensors (NCCL) only queues work: two CUDA events recorded on the current stream
around it time it on the device timeline, read in :meth:`CollectiveWaits.take` after
the ``synchronize`` that ends the rank's timing (:func:`reactor_dist.device.wait_for_device`);
events not complete by then (a call that raised) are left out.  An ``async_op=True``
call (and ``isend``/``irecv``) returns its handle wrapped: the time inside its
``wait()`` counts (on CUDA: the current stream's stall there).  A collective called
inside another wrapped one counts once.  Not seen: calls through
``torch.distributed.distributed_c10d`` directly or functional collectives (DTensor).
"""

from __future__ import annotations

import functools
import time
from typing import Any

COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_tensor", "broadcast", "barrier", "monitored_barrier", "all_to_all",
    "all_to_all_single", "gather", "scatter", "reduce", "send", "recv", "isend", "irecv",
    "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
)


class CollectiveWaits:
    """The seconds one rank waited in collectives since :meth:`begin`."""

    def __init__(self, cuda: Any = None) -> None:
        self.cuda = cuda  # torch.cuda on a CUDA rank, else None
        self.host = 0.0   # wall seconds of host-blocking collectives
        self.depth = 0    # >0 inside a wrapped collective (a nested one is not counted)
        self.events: list[tuple[Any, Any]] = []  # reused pairs of timing CUDA events
        self.used = 0     # pairs recorded in this call

    def begin(self) -> None:
        self.host, self.used = 0.0, 0

    def take(self) -> float:
        """The seconds waited since :meth:`begin` (device events: only the complete)."""
        total = self.host
        for start, end in self.events[:self.used]:
            try:
                if end.query():
                    total += start.elapsed_time(end) / 1e3
            except RuntimeError:  # a CUDA error of this step: not ours to report
                pass
        self.begin()
        return total

    def pair(self) -> tuple[Any, Any]:
        """The next pair of timing events (created once, reused call after call)."""
        if self.used == len(self.events):
            event = self.cuda.Event
            self.events.append((event(enable_timing=True), event(enable_timing=True)))
        pair = self.events[self.used]
        self.used += 1
        return pair


def on_cuda(args: tuple, kwargs: dict) -> bool:
    """Whether a collective's first tensor argument (or first of a list) is a CUDA one."""
    first = args[0] if args else next(iter(kwargs.values()), None)
    if isinstance(first, (list, tuple)):
        first = first[0] if first else None
    return bool(getattr(first, "is_cuda", False))


class TimedWork:
    """An ``async_op`` handle whose ``wait()`` is counted; anything else is passed on."""

    __slots__ = ("work", "waits", "device")

    def __init__(self, work: Any, waits: CollectiveWaits, device: bool) -> None:
        self.work, self.waits, self.device = work, waits, device

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        waits = self.waits
        if self.device:
            start, end = waits.pair()
            start.record()
            try:
                return self.work.wait(*args, **kwargs)
            finally:
                end.record()
        began = time.perf_counter()
        try:
            return self.work.wait(*args, **kwargs)
        finally:
            waits.host += time.perf_counter() - began

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


def timed(fn: Any, waits: CollectiveWaits) -> Any:
    @functools.wraps(fn)
    def collective(*args: Any, **kwargs: Any) -> Any:
        if waits.depth:
            return fn(*args, **kwargs)
        device = waits.cuda is not None and on_cuda(args, kwargs)
        waits.depth += 1
        if device:
            start, end = waits.pair()
            start.record()
            try:
                work = fn(*args, **kwargs)
            finally:
                waits.depth -= 1
                end.record()
        else:
            began = time.perf_counter()
            try:
                work = fn(*args, **kwargs)
            finally:
                waits.depth -= 1
                waits.host += time.perf_counter() - began
        if work is not None and hasattr(work, "wait"):
            return TimedWork(work, waits, device)
        return work

    collective.__reactor_dist_untimed__ = fn  # type: ignore[attr-defined]
    return collective


_installed: CollectiveWaits | None = None


def install(device: str) -> CollectiveWaits:
    """Time the collectives of this process from now on (idempotent: a rejoin keeps the
    wrappers); ``device`` is the rank's ("cpu" or "cuda:N")."""
    global _installed
    if _installed is None:
        import torch.distributed as dist

        cuda = None
        if device.startswith("cuda"):
            import torch.cuda as cuda
        _installed = CollectiveWaits(cuda)
        for name in COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is not None:
                setattr(dist, name, timed(fn, _installed))
    return _installed
