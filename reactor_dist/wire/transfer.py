"""Payloads: pickle protocol 5 with large buffers out of band, through shared memory.

Encoding a payload yields a small pickle stream plus its out-of-band buffers.
Each buffer is placed by size::

    < INLINE_LIMIT   -> its own ZeroMQ frame (cheaper than a segment round trip)
    already in a pool segment (shared_empty)  -> referenced where it lies: no copy
    otherwise        -> copied once into a pooled, warm segment

and described in the message header by a :class:`~reactor_dist.wire.protocol.Descriptor`.
Decoding hands
``pickle.loads`` views of those frames and segments, so numpy arrays come back
viewing the shared memory itself.

Besides what numpy already sends out of band (C- or F-contiguous arrays), the
pickler sends non-contiguous arrays (as one contiguous copy) and CPU torch
tensors (as their raw bytes) out of band too, instead of a large in-band pickle.

A tensor (or storage) on any other device (CUDA, MPS, ...) arrives as a CPU tensor:
torch's own pickling of it would put the whole storage in-band and rebuild it with
``torch.load`` on the receiver's device, initialising CUDA in the application (or
failing where it has none).  Rank 0's large CUDA tensors go straight into page-locked
result segments (``staging``: :mod:`reactor_dist.rank.staging`); any other is copied to the
CPU first (:func:`on_cpu`).
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import sys
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import numpy as np

from ..shm.ledger import Ledger
from ..shm.segments import align, allocation_error
from . import framing
from .protocol import MAX_FRAME_ENV, MAX_MESSAGE_ENV, Descriptor, Place

# Measured (benchmarks/inline_threshold.py): below ~64 KiB a ZeroMQ frame copy is cheaper
# than a segment round trip; above it the segment wins. Overridable for that measurement.
INLINE_LIMIT = int(os.environ.get("REACTOR_DIST_INLINE_LIMIT", 64 * 1024))
IN_BAND = 1 << 62  # an inline_limit that keeps every buffer in-band (no shared memory)


def _rebuild_tensor(raw: np.ndarray, dtype: str, shape: tuple, requires_grad: bool):
    import torch

    tensor = torch.from_numpy(raw).view(getattr(torch, dtype)).reshape(shape)
    return tensor.requires_grad_(requires_grad) if requires_grad else tensor


def _rebuild_readonly(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


def on_cpu(obj: Any) -> Any:
    """What a torch tensor or storage crosses as: itself on the CPU; from any other
    device (``device.type != "cpu"``) its ``.detach().cpu()`` copy, so that the receiver
    never rebuilds it on a device of its own.  A TypeError where no copy can be made
    (a ``meta`` tensor has no data)."""
    if obj.device.type == "cpu":
        return obj
    try:
        return (obj.detach() if hasattr(obj, "detach") else obj).cpu()
    except Exception as exc:
        raise TypeError(
            f"a torch {type(obj).__name__} on device {str(obj.device)!r} cannot be sent: "
            f"tensors cross the runner through the CPU, and copying it there failed "
            f"({type(exc).__name__}: {exc}). Send a tensor that holds data (on the CPU or "
            f"a GPU); it arrives on the CPU (move it with .to(device))") from exc


class _Pickler(pickle.Pickler):
    # Called with the size of each contiguous copy before it is made: may refuse it.
    admit: Callable[[int], None] = staticmethod(lambda nbytes: None)
    staging: Any = None  # rank 0's device tensors into result segments (staging.py)

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is np.ndarray:
            if self.staging is not None:
                self.staging.look_at(obj)  # .cpu().numpy()? returning the tensor is faster
            if obj.flags.c_contiguous or obj.flags.f_contiguous or obj.dtype.hasobject:
                return NotImplemented
            self.admit(obj.nbytes)
            copy = np.ascontiguousarray(obj)
            if not obj.flags.writeable:
                return _rebuild_readonly, (copy,)
            return copy.__reduce_ex__(5)
        torch = sys.modules.get("torch")
        if torch is None:
            return NotImplemented
        if isinstance(obj, (torch.UntypedStorage, torch.TypedStorage)):
            # torch pickles a storage with torch.save; torch.load would restore it on its
            # device in the receiver: a non-CPU one crosses as its CPU copy.
            return NotImplemented if obj.device.type == "cpu" else on_cpu(obj).__reduce_ex__(5)
        if isinstance(obj, torch.Tensor) and type(obj) is not torch.Tensor:
            if obj.device.type == "cpu" or isinstance(obj, torch.nn.Parameter):
                return NotImplemented  # a Parameter pickles its .data, a plain tensor
            return on_cpu(obj).__reduce_ex__(5)  # a subclass, reduced as on the CPU
        if type(obj) is torch.Tensor:
            requires_grad = obj.requires_grad
            dtype = str(obj.dtype).removeprefix("torch.")
            if self.staging is not None and self.staging.wants(obj):
                raw = self.staging.stage(obj)
                if raw is not None:
                    return _rebuild_tensor, (raw, dtype, tuple(obj.shape), requires_grad)
            obj = on_cpu(obj)
            if obj.is_sparse or obj.is_quantized or obj.is_nested:
                return obj.__reduce_ex__(5)
            if not obj.is_contiguous():
                self.admit(obj.nbytes)
            flat = obj.detach().contiguous().reshape(-1)
            raw = flat.view(torch.uint8).numpy() if flat.numel() else np.empty(0, np.uint8)
            return _rebuild_tensor, (raw, dtype, tuple(obj.shape), requires_grad)
        return NotImplemented


_SCALARS = frozenset({type(None), bool, int, float, complex, str, bytes})


def dumps(obj: Any, admit: Callable[[int], None] | None = None,
          staging: Any = None) -> tuple[bytes, list[pickle.PickleBuffer]]:
    """The pickle stream and out-of-band buffers of ``obj``; given ``staging``, the
    device-to-host copies it queued are done when this returns (or raises)."""
    buffers: list[pickle.PickleBuffer] = []
    stream = io.BytesIO()
    pickler = _Pickler(stream, protocol=5, buffer_callback=buffers.append)
    if admit is not None:
        pickler.admit = admit
    if staging is None:
        pickler.dump(obj)
        return stream.getvalue(), buffers
    pickler.staging = staging
    try:
        pickler.dump(obj)
    finally:
        staging.wait()  # before anybody reads the segments (the digest, the caller)
    return stream.getvalue(), buffers


def _room_check(ledger: Ledger, what: str, inline_limit: int) -> Callable[[int], None]:
    """Refuses (SharedMemoryExhausted) a pickling copy that, with the copies before
    it, could never fit in the ledger's shared memory: before it is made."""
    copies = 0

    def admit(nbytes: int) -> None:
        nonlocal copies
        if nbytes >= inline_limit:
            copies += nbytes
            if copies > ledger.room():
                raise allocation_error(ledger.directory, copies, what)
    return admit


def _check_in_band(in_band: list[int], stream: int, what: str) -> None:
    """Refuse, before anything is sent, a payload the receiver would drop unread
    (``in_band``: the sizes of the buffers that travel as frames of their own)."""
    if max(in_band, default=0) > framing.MAX_FRAME:
        raise ValueError(
            f"{what} holds an array of {max(in_band) >> 20} MiB that travels in-band (to a "
            f"rank on another node), above the bus's bound of {framing.MAX_FRAME >> 20} MiB a "
            f"frame ({MAX_FRAME_ENV}); split it or raise the bound")
    if stream + sum(in_band) > framing.MAX_MESSAGE:
        raise ValueError(
            f"{what} sends {(stream + sum(in_band)) >> 20} MiB in-band, above the bus's bound "
            f"of {framing.MAX_MESSAGE >> 20} MiB a message ({MAX_MESSAGE_ENV})")


def _address(view: memoryview) -> int:
    return np.frombuffer(view, np.uint8).ctypes.data


WORD_SUMS_FROM = 1 << 20  # bytes: a buffer this big is digested by word sums, not hashed


class Digest:
    """A digest of payloads, to tell whether a re-run gave what the first run gave
    (sessions' replay, :mod:`reactor_dist.caller.session`): the pickle streams and small
    buffers hashed, each large buffer by the wrapping sum and the xor of its 64-bit
    words (0.4 of a memcpy; a hash would cost 2-10 of them on every call).  Made to
    catch a model that is not deterministic, not a forger."""

    def __init__(self) -> None:
        self.hash = hashlib.blake2b(digest_size=16)

    def update(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        n = view.nbytes
        self.hash.update(n.to_bytes(8, "little"))
        if n < WORD_SUMS_FROM:
            self.hash.update(view)
            return
        words = np.frombuffer(view, np.uint64, n // 8)
        self.hash.update(int(words.sum(dtype=np.uint64)).to_bytes(8, "little"))
        self.hash.update(int(np.bitwise_xor.reduce(words)).to_bytes(8, "little"))
        self.hash.update(view[n - n % 8:])

    def digest(self) -> bytes:
        return self.hash.digest()


def _unpicklable(what: str, obj: Any, exc: BaseException, verb: str) -> TypeError:
    """The one message for rank 0's result or item that does not pickle (``verb``:
    "return" or "yield"): a TypeError, like pickle's own "cannot pickle" errors."""
    return TypeError(
        f"{what} (a {type(obj).__name__}) cannot be pickled ({type(exc).__name__}: {exc}): "
        f"{verb} numpy arrays, tensors, plain Python data, or instances of a class defined "
        f"at the top level of a module")


def encode(obj: Any, ledger: Ledger, what: str | Callable[[], str], holders: Iterable[Hashable],
           reuse_segments: bool = False, inline_limit: int = INLINE_LIMIT,
           verb: str | None = None, digest: Digest | None = None,
           staging: Any = None,
           ) -> tuple[list[Descriptor], list, list[str]]:
    """``(descriptors, frames, segment names)`` for one payload.

    Raises, before anything was sent, SharedMemoryExhausted (no room), ValueError
    (over the bus's bounds) or whatever pickling raises; given ``verb`` (rank 0's
    results), a pickling failure is one TypeError that says what to send instead.
    ``holders`` hold every segment the payload lies in; ``digest`` takes in the payload;
    ``staging`` (rank 0) puts its large device tensors straight into ``ledger``'s
    segments (they must be found there: ``reuse_segments``).  ``what`` names the payload
    in errors; a function that makes the name is called only past the scalars' path.
    """
    if type(obj) in _SCALARS:  # the per-call fast path: one pickle stream, nothing else
        stream = pickle.dumps(obj, protocol=5)
        if len(stream) <= framing.MAX_FRAME:
            if digest is not None:
                digest.update(stream)
            return [], [stream], []
    if not isinstance(what, str):
        what = what()
    try:
        stream, buffers = dumps(obj, _room_check(ledger, what, inline_limit), staging)
    except Exception as exc:
        if verb is None or isinstance(exc, MemoryError):  # MemoryError: no room in shm
            raise
        raise _unpicklable(what, obj, exc, verb) from exc
    if digest is not None:
        digest.update(stream)
        for pb in buffers:
            digest.update(pb.raw())
    if len(stream) > framing.MAX_FRAME:  # the receiver would drop it unread
        raise ValueError(
            f"{what} pickles to {len(stream) >> 20} MiB in-band, above the bus's bound of "
            f"{framing.MAX_FRAME >> 20} MiB ({MAX_FRAME_ENV}); numpy arrays and tensors travel "
            f"in shared memory instead, bytes and str do not")
    if not buffers:
        return [], [stream], []
    holders = list(holders)
    frames: list[Any] = [stream]
    descriptors: list[Any] = []
    copies: list[tuple[int, memoryview]] = []
    found_segments: list[str] = []
    for pb in buffers:
        raw = pb.raw()
        n, ro = raw.nbytes, raw.readonly
        if n < inline_limit:
            descriptors.append(Descriptor(Place.INLINE, len(frames), 0, n, ro))
            frames.append(raw)
            continue
        found = ledger.find(_address(raw), n) if reuse_segments else None
        if found is not None:
            seg, offset = found
            descriptors.append(Descriptor(Place.SEGMENT, seg.name, offset, n, ro))
            if seg.name not in found_segments:
                found_segments.append(seg.name)
            continue
        descriptors.append(None)  # filled once the copy segment is known
        copies.append((len(descriptors) - 1, raw))
    _check_in_band([frame.nbytes for frame in frames[1:]], len(stream), what)
    used = list(found_segments)
    if copies:
        total = sum(align(raw.nbytes) for _, raw in copies)
        seg = ledger.acquire(total, what, holders)
        target = np.frombuffer(seg.mm, np.uint8)
        offset = 0
        for index, raw in copies:
            n = raw.nbytes
            np.copyto(target[offset:offset + n], np.frombuffer(raw, np.uint8))
            descriptors[index] = Descriptor(Place.SEGMENT, seg.name, offset, n, raw.readonly)
            offset += align(n)
        del target
        used.append(seg.name)
    # Only now, with nothing left to fail, do the holders take the segments they view.
    for name in found_segments:
        for holder in holders:
            ledger.hold(name, holder)
    return descriptors, frames, used


def decode(descriptors: list | None, frames: list,
           segment_base: Callable[[str], np.ndarray]) -> Any:
    """Rebuild a payload from its wire descriptors (5-item arrays, see Descriptor);
    ``segment_base(name)`` gives a uint8 array over a segment."""
    if not frames:
        raise ValueError("payload has no pickle frame")
    if not descriptors:
        return pickle.loads(frames[0])
    views = []
    bases: dict[str, np.ndarray] = {}
    for loc, where, offset, n, ro in descriptors:
        if loc == Place.INLINE:
            frame = frames[where]
            view = memoryview(frame) if ro else memoryview(bytearray(frame))
        else:
            if where not in bases:
                bases[where] = segment_base(where)
            view = memoryview(bases[where][offset:offset + n])
            if ro:
                view = view.toreadonly()
        if view.nbytes != n:
            raise ValueError(f"buffer {len(views)} has {view.nbytes} bytes, expected {n}")
        views.append(view)
    bases.clear()
    return pickle.loads(frames[0], buffers=views)
