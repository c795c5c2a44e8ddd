"""A rank's seconds waiting in ``torch.distributed`` collectives during one call.

Why: a rank that is slow *before* a collective makes the others wait inside it, so every
rank's compute (:mod:`reactor_dist.caller.timings`) comes out the same and the straggler is
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
inside another wrapped one counts once.  The same functions of
``torch.distributed.distributed_c10d`` are replaced too (a call through that module's
attribute is timed).

Each wrapper also records its collective in the rank's ring
(:mod:`reactor_dist.shm.collective_ring`): kind, group, tensors, its number within the
call, entered and left, so that the caller can say which collective a rank hangs or
died in.  DTensor's functional collectives (``torch.distributed._functional_collectives``,
:data:`FUNCTIONAL`) are recorded but not timed: they only queue work, and their wait
(``wait_tensor``) marks the entry as waited in and left.  Not seen: a function bound by
name before :func:`install` (``from torch.distributed import all_reduce`` in a module
imported before the group formed, as torch's own modules do), ``torch.ops._c10d_functional``
called directly, and collectives run from C++ (a compiled graph's).
"""

from __future__ import annotations

import functools
import inspect
import time
from typing import Any

from ..shm import collective_ring as ring_layout

COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_tensor", "broadcast", "barrier", "monitored_barrier", "all_to_all",
    "all_to_all_single", "gather", "scatter", "reduce", "send", "recv", "isend", "irecv",
    "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
)
# torch.distributed._functional_collectives: recorded, not timed (they queue work)
FUNCTIONAL = (
    "all_reduce", "all_gather_tensor", "all_gather_tensor_autograd", "reduce_scatter_tensor",
    "reduce_scatter_tensor_autograd", "all_to_all_single", "all_to_all_single_autograd",
    "broadcast", "permute_tensor", "all_reduce_coalesced", "all_gather_into_tensor_coalesced",
    "reduce_scatter_tensor_coalesced",
)
# The parameters whose tensors an entry records (the root's lists of gather and scatter
# are the root's alone: not compared).
TENSOR_PARAMS = ("tensor", "self", "tensor_list", "output_tensor", "input_tensor", "output",
                 "input", "input_list", "output_tensor_list", "input_tensor_list")
PEER_PARAMS = ("dst", "src")


class CollectiveWaits:
    """The seconds one rank waited in collectives since :meth:`begin`."""

    def __init__(self, cuda: Any = None) -> None:
        self.cuda = cuda  # torch.cuda on a CUDA rank, else None
        self.ring: ring_layout.Writer | None = None  # this rank's ring, when the runner made one
        self.world_size = 1
        self.groups: dict[int, tuple[Any, tuple[int, tuple[int, ...]]]] = {}  # id -> key
        self.pending: dict[int, int] = {}  # a functional collective's tensor -> its entry
        self.host = 0.0   # wall seconds of host-blocking collectives
        self.depth = 0    # >0 inside a wrapped collective (a nested one is not counted)
        self.events: list[tuple[Any, Any]] = []  # reused pairs of timing CUDA events
        self.used = 0     # pairs recorded in this call

    def begin(self, seq: int | None = None) -> None:
        """A call's timing begins; with ``seq``, its collectives are numbered from 1."""
        self.host, self.used = 0.0, 0
        if seq is not None and self.ring is not None:
            self.ring.begin(seq)
            self.pending.clear()

    def group_key(self, group: Any) -> tuple[int, tuple[int, ...]]:
        """A group's key in the ring: (0, ()) for every rank (cached per group object,
        which the cache keeps alive so that its id is not reused)."""
        if group is None:
            return 0, ()
        if isinstance(group, tuple) and len(group) == 2 and hasattr(group[0], "get_group"):
            group = group[0].get_group(group[1])  # (device mesh, its dimension)
        if isinstance(group, (list, tuple)):
            flat = [r for g in group for r in (g if isinstance(g, (list, tuple)) else (g,))]
            return ring_layout.group_key(flat, self.world_size)
        known = self.groups.get(id(group))
        if known is None:
            known = group, ring_layout.group_key(group_ranks(group) or
                                                 range(self.world_size), self.world_size)
            self.groups[id(group)] = known
        return known[1]

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


def group_ranks(group: Any) -> list[int] | None:
    """The global ranks of a process group, device mesh or functional group name."""
    try:
        import torch.distributed as dist

        if hasattr(dist, "DeviceMesh") and isinstance(group, dist.DeviceMesh):
            group = group.get_group()
        if isinstance(group, str):
            from torch.distributed import distributed_c10d as c10d

            group = c10d._resolve_process_group(group)
        return list(dist.get_process_group_ranks(group))
    except Exception:  # a form we do not know: filed under every rank
        return None


class Recorded:
    """What a wrapper records of its collective: its kind, where its tensors, group and
    peer are among the arguments (from the function's signature)."""

    def __init__(self, name: str, fn: Any) -> None:
        self.kind = ring_layout.KIND_CODE.get(name, 0)
        try:
            params = list(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            params = []
        self.tensors = [(params.index(p), p) for p in params if p in TENSOR_PARAMS]
        self.group = (params.index("group"), "group") if "group" in params else None
        peer = next((p for p in params if p in PEER_PARAMS), None)
        self.peer = (params.index(peer), peer) if peer and name in \
            ring_layout.POINT_TO_POINT else None
        # one tensor, no peer: the common case, recorded by a shorter path (:meth:`enter`)
        self.one = self.tensors[0] if len(self.tensors) == 1 and self.peer is None else None

    def enter(self, ring: ring_layout.Writer, waits: CollectiveWaits, args: tuple,
              kwargs: dict) -> int:
        """The collective's entry in the ring; -1 where its arguments are of a form the
        entry cannot hold (recording never breaks a collective)."""
        try:
            one = self.one
            if one is not None:  # a tensor (not a list) for every rank's group
                at, name = one
                tensor = args[at] if at < len(args) else kwargs.get(name)
                group = self.group
                if group is not None:
                    at, name = group
                    group = args[at] if at < len(args) else kwargs.get(name)
                if group is None and type(tensor) is not list:
                    shape = getattr(tensor, "shape", None)
                    if shape is not None:
                        return ring.enter_one(self.kind, DTYPE_CODE.get(tensor.dtype, 0),
                                              shape)
            return self.record(ring, waits, args, kwargs)
        except Exception:
            return -1

    def record(self, ring: ring_layout.Writer, waits: CollectiveWaits, args: tuple,
               kwargs: dict) -> int:
        tensors = []
        for at, name in self.tensors:
            value = args[at] if at < len(args) else kwargs.get(name)
            listed = 0
            if isinstance(value, (list, tuple)):
                listed = len(value)
                value = value[0] if value else None
            shape = getattr(value, "shape", None)
            if shape is not None:
                tensors.append((DTYPE_CODE.get(value.dtype, 0), shape, listed))
        group = (0, ())
        if self.group is not None:
            at, name = self.group
            given = args[at] if at < len(args) else kwargs.get(name)
            if given is not None:
                group = waits.group_key(given)
        peer = -1
        if self.peer is not None:
            at, name = self.peer
            value = args[at] if at < len(args) else kwargs.get(name)
            peer = value if isinstance(value, int) else -1
        return ring.enter(self.kind, tensors, group, peer)


DTYPE_CODE: dict[Any, int] = {}


def dtype_codes() -> dict[Any, int]:
    """torch's dtypes -> their codes in an entry."""
    import torch

    return {getattr(torch, name): code for code, name in enumerate(ring_layout.DTYPES)
            if isinstance(getattr(torch, name, None), torch.dtype)}


class TimedWork:
    """An ``async_op`` handle whose ``wait()`` is counted; anything else is passed on."""

    __slots__ = ("work", "waits", "device", "entry")

    def __init__(self, work: Any, waits: CollectiveWaits, device: bool,
                 entry: int = -1) -> None:
        self.work, self.waits, self.device, self.entry = work, waits, device, entry

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        waits = self.waits
        ring, entry = waits.ring, self.entry
        if ring is not None and entry >= 0:
            ring.mark(entry, ring_layout.WAITING)
            try:
                result = self.timed_wait(args, kwargs)
            except BaseException:
                ring.mark(entry, ring_layout.RAISED)
                raise
            ring.mark(entry, ring_layout.LEFT)
            return result
        return self.timed_wait(args, kwargs)

    def timed_wait(self, args: tuple, kwargs: dict) -> Any:
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


def timed(fn: Any, waits: CollectiveWaits, name: str = "") -> Any:
    recorded = Recorded(name or fn.__name__, fn)

    @functools.wraps(fn)
    def collective(*args: Any, **kwargs: Any) -> Any:
        if waits.depth:
            return fn(*args, **kwargs)
        device = waits.cuda is not None and on_cuda(args, kwargs)
        ring = waits.ring
        entry = recorded.enter(ring, waits, args, kwargs) if ring is not None else -1
        waits.depth += 1
        if device:  # its time is the device's, between two events
            start, end = waits.pair()
            start.record()
        else:
            began = time.perf_counter()
        try:
            work = fn(*args, **kwargs)
        except BaseException:
            if ring is not None:
                ring.mark(entry, ring_layout.RAISED)
            raise
        finally:
            waits.depth -= 1
            if device:
                end.record()
            else:
                waits.host += time.perf_counter() - began
        if work is not None and hasattr(work, "wait"):
            if ring is not None:
                ring.mark(entry, ring_layout.QUEUED)
            return TimedWork(work, waits, device, entry)
        if ring is not None:  # on a device: queued, its end is the device's
            ring.mark(entry, ring_layout.QUEUED if device else ring_layout.LEFT)
        return work

    collective.__reactor_dist_untimed__ = fn  # type: ignore[attr-defined]
    return collective


def recorded_only(fn: Any, waits: CollectiveWaits, name: str) -> Any:
    """A functional collective: recorded (entered; queued when it returns), not timed."""
    recorded = Recorded(name, fn)

    @functools.wraps(fn)
    def collective(*args: Any, **kwargs: Any) -> Any:
        ring = waits.ring
        if waits.depth or ring is None:
            return fn(*args, **kwargs)
        entry = recorded.enter(ring, waits, args, kwargs)
        waits.depth += 1
        try:
            out = fn(*args, **kwargs)
        except BaseException:
            ring.mark(entry, ring_layout.RAISED)
            raise
        finally:
            waits.depth -= 1
        ring.mark(entry, ring_layout.QUEUED)
        for tensor in out if isinstance(out, (list, tuple)) else (out,):
            waits.pending[id(getattr(tensor, "elem", tensor))] = entry
        return out

    collective.__reactor_dist_untimed__ = fn  # type: ignore[attr-defined]
    return collective


def waited(fn: Any, waits: CollectiveWaits) -> Any:
    """``wait_tensor``: a functional collective's entry is waited in, then left."""

    @functools.wraps(fn)
    def wait_tensor(tensor: Any) -> Any:
        ring = waits.ring
        entry = waits.pending.pop(id(tensor), -1) if ring is not None else -1
        if entry < 0:
            return fn(tensor)
        ring.mark(entry, ring_layout.WAITING)
        try:
            out = fn(tensor)
        except BaseException:
            ring.mark(entry, ring_layout.RAISED)
            raise
        ring.mark(entry, ring_layout.LEFT)
        return out

    wait_tensor.__reactor_dist_untimed__ = fn  # type: ignore[attr-defined]
    return wait_tensor


_installed: CollectiveWaits | None = None


def install(device: str, ring: str | None = None, world_size: int = 1) -> CollectiveWaits:
    """Time the collectives of this process from now on (idempotent: a rejoin keeps the
    wrappers); ``device`` is the rank's ("cpu" or "cuda:N").  ``ring``: the path of this
    rank's collective ring (collective_ring.ring_name), recorded into from now on (a
    spare that took a rank's place opens that rank's); missing: nothing is recorded."""
    global _installed
    if _installed is None:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        cuda = None
        if device.startswith("cuda"):
            import torch.cuda as cuda
        _installed = CollectiveWaits(cuda)
        DTYPE_CODE.update(dtype_codes())
        for name in COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is not None:
                wrapper = timed(fn, _installed, name)
                setattr(dist, name, wrapper)
                if getattr(c10d, name, None) is fn:
                    setattr(c10d, name, wrapper)
        try:
            import torch.distributed._functional_collectives as funcol
        except ImportError:  # pragma: no cover - every torch we support has it
            funcol = None
        if funcol is not None:
            for name in FUNCTIONAL:
                fn = getattr(funcol, name, None)
                if fn is not None:
                    setattr(funcol, name, recorded_only(fn, _installed, f"funcol.{name}"))
            if getattr(funcol, "wait_tensor", None) is not None:
                funcol.wait_tensor = waited(funcol.wait_tensor, _installed)
    _installed.world_size = world_size
    if ring is not None:
        try:
            _installed.ring = ring_layout.Writer(ring)
        except (OSError, ValueError):  # no ring here (a rank on another machine)
            _installed.ring = None
    return _installed
