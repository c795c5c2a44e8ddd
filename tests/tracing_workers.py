"""The worker the tracing tests drive (tests/test_tracing.py)."""

from __future__ import annotations

from reactor_dist import DistributedWorker


class Counts(DistributedWorker):
    """Yields 0..n-1; a negative ``n`` raises the same ValueError on every rank."""

    def generate(self, n: int):
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        yield from range(n)
