"""A worker for the metrics tests: each input names one way a call can end."""

from __future__ import annotations

import os
import time

from reactor_dist import DistributedWorker


class Metered(DistributedWorker):
    """``"raise"``: ValueError on every rank; ``"crash"``: rank 1 exits;
    ``{"sleep": s}``: rank 0 sleeps ``s`` seconds, the others 0.9 ``s``;
    ``{"stream": n}``: yields 0..n-1; anything else is returned."""

    def generate(self, x, /):
        if x == "raise":
            raise ValueError(f"asked to raise on rank {self.rank}")
        if x == "crash" and self.rank == 1:
            os._exit(3)
        if isinstance(x, dict) and "sleep" in x:
            time.sleep(x["sleep"] * (1.0 if self.rank == 0 else 0.9))
            return x
        if isinstance(x, dict) and "stream" in x:
            return iter_items(x["stream"])
        return x

    def reset(self) -> None:
        pass


def iter_items(n: int):
    yield from range(n)
