"""``python -m benchmarks.ring_entry_cost [--calls N]``: what recording one collective in
a rank's ring costs, timed alone in this process (no ranks, no group): the entry as a
wrapped ``all_reduce`` writes it and its mark, and a call's ``begin``.

A diagnostic for the collective rings' row of ``make bench`` (which times whole calls
with the ring on and off, where a delay before a collective costs more than itself);
it asserts nothing.  The ring is a file in /dev/shm, as the runner's are: it is
unlinked as soon as it is mapped, so that nothing is left behind however this ends.
"""

from __future__ import annotations

import argparse
import mmap
import os
import tempfile
import timeit

from reactor_dist.rank import collective_wait
from reactor_dist.shm import collective_ring, segments


def mapped_ring() -> collective_ring.Writer:
    """A fresh ring, mapped by a Writer, its file already gone from /dev/shm."""
    fd, path = tempfile.mkstemp(prefix="rd-ring-cost-", dir=segments.DEFAULT_DIR)
    try:
        os.ftruncate(fd, collective_ring.SIZE)
        with mmap.mmap(fd, collective_ring.SIZE) as buffer:
            collective_ring.fresh(buffer)
        return collective_ring.Writer(path)
    finally:
        os.close(fd)
        os.unlink(path)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.ring_entry_cost",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=200_000, help="timed repetitions of each")
    calls = ap.parse_args().calls

    import torch
    import torch.distributed as dist

    collective_wait.DTYPE_CODE.update(collective_wait.dtype_codes())
    ring = mapped_ring()
    waits = collective_wait.CollectiveWaits()
    waits.ring, waits.world_size = ring, 2
    all_reduce = collective_wait.Recorded("all_reduce", dist.all_reduce)
    tensor = torch.ones(1)
    ring.begin(1)

    def entry_and_mark() -> None:
        ring.mark(all_reduce.enter(ring, waits, (tensor,), {}), collective_ring.LEFT)

    for name, fn in (("an all_reduce's entry and its mark", entry_and_mark),
                     ("a call's begin", lambda: ring.begin(1))):
        print(f"{name}: {timeit.timeit(fn, number=calls) / calls * 1e6:.2f} µs")
    ring.mm.close()


if __name__ == "__main__":
    main()
