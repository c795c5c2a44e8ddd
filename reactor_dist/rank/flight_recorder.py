"""A rank's torch group's own flight recorder, read for the caller on a timeout.

Why: the wrappers of :mod:`reactor_dist.rank.collective_wait` see the collectives Python
calls through ``torch.distributed``; the process group itself (gloo, and NCCL) keeps a
record of every collective it ran, those of a compiled graph or of C++ too, and on NCCL
whether its kernel started and finished on the device.  torch 2.13 keeps it by default
(2000 entries; ``TORCH_FR_BUFFER_SIZE``, or its older name
``TORCH_NCCL_TRACE_BUFFER_SIZE``, sizes it, 0 turns it off; older versions keep none
unless sized) and dumps it by itself only to a file, at NCCL's own timeout.  It is not
free: +7 to +9 µs a gloo ``all_reduce`` of one float (``python -m
benchmarks.recorder_cost``), so the runner leaves its size to torch and the application,
and sets it to 0 with ``record_collectives=False`` (unless the application sized it).

How: on :data:`~reactor_dist.wire.protocol.RECORDER_SIGNAL`, sent by the caller when a
call times out, a thread of the rank (:func:`answer`; the main thread may be waiting
inside a collective) dumps the recorder and writes its newest entries into the rank's
ring (``collective_ring.write_recorded``), where the caller reads them.
"""

from __future__ import annotations

import pickle
import signal
import threading
from typing import Any

from ..shm import collective_ring
from ..wire.protocol import RECORDER_SIGNAL

NEWEST = 8  # entries the caller is given

_answering: list[Any] = []  # the ring the thread writes to (a spare's changes once)


def newest() -> list[dict]:
    """The recorder's newest entries, each cut to what the caller shows
    (collective_ring.recorder_entry); [] where this torch has no recorder or it is off."""
    try:
        from torch._C import _distributed_c10d as c10d
    except ImportError:
        return []
    dump = getattr(c10d, "_dump_fr_trace", None) or getattr(c10d, "_dump_nccl_trace", None)
    if dump is None:
        return []
    try:
        trace = pickle.loads(dump(True, False, False))
    except Exception:  # the recorder off, or a backend without one
        return []
    return [collective_ring.recorder_entry(e) for e in (trace.get("entries") or [])[-NEWEST:]]


def answer(ring: collective_ring.Writer) -> None:
    """Answer each RECORDER_SIGNAL into ``ring`` from now on (one thread per process;
    the signal is blocked in every thread from the rank's start: group.block_rank_signals)."""
    first = not _answering
    _answering[:] = [ring]

    def wait() -> None:
        while True:
            signal.sigwait({RECORDER_SIGNAL})
            try:
                collective_ring.write_recorded(_answering[0].mm, newest())
            except (ValueError, OSError):  # the ring closed meanwhile
                pass

    if first:
        threading.Thread(target=wait, name="reactor-dist-flight-recorder", daemon=True).start()
