"""A rank's torch group's own flight recorder, read for the caller on a timeout.

Why: the wrappers of :mod:`reactor_dist.rank.collective_wait` see the collectives Python
calls through ``torch.distributed``; the process group itself (gloo, and NCCL) keeps a
record of every collective it ran, those of a compiled graph or of C++ too, and on NCCL
whether its kernel started and finished on the device.  NCCL keeps its own recorder
(``_dump_nccl_trace``), every other backend gloo's (``_dump_fr_trace``): a CUDA rank's
group has both (CPU tensors through gloo), and its report merges them by time and says
which it read.  torch 2.13 keeps it by default (read in 2.13 alone)
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
# Which recorder keeps which backend's collectives, and its dump in torch._C: NCCL's
# (the CUDA recorder, on a CUDA build) and the one of every other backend, gloo's
# (torch 2.8 and later; checked on 2.11 with CUDA and 2.13 on CPU).
RECORDERS = (("NCCL", "_dump_nccl_trace"), ("gloo", "_dump_fr_trace"))

_answering: list[Any] = []  # the ring the thread writes to (a spare's changes once)


def traces(device: str) -> dict[str, list[dict]]:
    """Every recorder's entries this rank's group may have written, by recorder: NCCL's
    on a CUDA rank, gloo's on every rank; none where torch has that recorder off or
    lacks it."""
    try:
        from torch._C import _distributed_c10d as c10d
    except ImportError:
        return {}
    found = {}
    for name, attribute in RECORDERS:
        dump = getattr(c10d, attribute, None)
        if dump is None or (name == "NCCL" and not device.startswith("cuda")):
            continue
        try:
            trace = pickle.loads(dump(True, False, False))
        except Exception:  # the recorder off, or a backend without one
            continue
        found[name] = list(trace.get("entries") or [])
    return found


def merged(found: dict[str, list[dict]]) -> list[dict]:
    """The NEWEST entries of every recorder, oldest first by the time each was created
    (an entry both recorders returned counts once), each cut to what the caller shows
    with the recorder that kept it (collective_ring.recorder_entry)."""
    seen, timed = set(), []
    for name, entries in found.items():
        for entry in entries:
            key = (entry.get("time_created_ns"), entry.get("profiling_name"),
                   entry.get("collective_seq_id"), entry.get("p2p_seq_id"))
            if key not in seen:
                seen.add(key)
                timed.append((entry.get("time_created_ns") or 0, name, entry))
    timed.sort(key=lambda t: t[0])
    return [collective_ring.recorder_entry(e, name) for _, name, e in timed[-NEWEST:]]


def newest(device: str) -> list[dict]:
    """The caller's view of this rank's recorders ([] where none keeps anything)."""
    return merged(traces(device))


def answer(ring: collective_ring.Writer, device: str) -> None:
    """Answer each RECORDER_SIGNAL into ``ring`` from now on, for a rank on ``device``
    (one thread per process; the signal is blocked in every thread from the rank's
    start: group.block_rank_signals)."""
    first = not _answering
    _answering[:] = [ring, device]

    def wait() -> None:
        while True:
            signal.sigwait({RECORDER_SIGNAL})
            try:
                collective_ring.write_recorded(_answering[0].mm, newest(_answering[1]))
            except (ValueError, OSError):  # the ring closed meanwhile
                pass

    if first:
        threading.Thread(target=wait, name="reactor-dist-flight-recorder", daemon=True).start()
