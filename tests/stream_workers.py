"""Generator workers for the streaming tests: each behaviour one class."""

from __future__ import annotations

import os
import time

import numpy as np
from sample_workers import maybe_fault

from reactor_dist import DistributedWorker


class Counts(DistributedWorker):
    """Yields ``{"i": i, "rank": rank}`` for i in range(n); rank 0's items reach the caller."""

    def generate(self, n: int):
        for i in range(n):
            yield {"i": i, "rank": self.rank}


class Frames(DistributedWorker):
    """Yields ``n`` frames of ``size`` bytes (4 MiB unless told) filled with their index:
    plain arrays (copied into shared memory by rank 0) or, with ``shared=True``, arrays
    from ``shared_empty``."""

    def generate(self, spec: dict):
        size = spec.get("size", 4 << 20)
        for i in range(spec["n"]):
            if spec.get("shared"):
                frame = self.shared_empty((size,), np.uint8)
                frame[:] = i
            else:
                frame = np.full(size, i, np.uint8)
            yield frame


class WaitsForTheCaller(DistributedWorker):
    """Rank 0 yields item 0, then waits until the caller says it has it (a file appears):
    the step can only end if item 0 reached the caller while the step was running."""

    def generate(self, path: str):
        yield "first"
        if self.rank == 0:
            deadline = time.monotonic() + 10
            while not os.path.exists(path) and time.monotonic() < deadline:
                time.sleep(0.01)
            yield "seen" if os.path.exists(path) else "never seen"
        else:
            yield "other"


class Slow(DistributedWorker):
    """Yields ``n`` items, ``pause`` seconds apart; ``hang_after`` items then hangs on
    ``hang_rank``."""

    def generate(self, spec: dict):
        for i in range(spec["n"]):
            if i == spec.get("hang_after") and self.rank == spec.get("hang_rank", 0):
                while True:
                    time.sleep(0.05)
            time.sleep(spec.get("pause", 0))
            yield i


class RaisesAfter(DistributedWorker):
    """Yields ``after`` items, then raises ``errors[rank]`` (None: this rank finishes)."""

    def generate(self, spec: dict):
        yield from range(spec["after"])
        error = spec["errors"][self.rank]
        if error == "value":
            raise ValueError(f"bad item on rank {self.rank}")
        if error == "key":
            raise KeyError(f"missing on rank {self.rank}")


class YieldsUnpicklable(DistributedWorker):
    """The first ``n`` of 0, a lambda, 2: the lambda cannot be sent (rank 0) and is
    ignored elsewhere."""

    def generate(self, n: int):
        yield 0
        if n > 1:
            yield lambda: None
        if n > 2:
            yield 2


class StreamFault(DistributedWorker):
    """Fires ``fault`` (sample_workers' fault dict) before the first of 3 items, after
    the first, or after the last (``fault["where"]``: before, between, after)."""

    def generate(self, fault: dict):
        where = {"before": 0, "between": 1, "after": 3}[fault["where"]]
        for i in range(3):
            if i == where:
                maybe_fault(fault, "stream")
            yield np.full(1 << 18, i, np.float32)
        if where == 3:
            maybe_fault(fault, "stream")
