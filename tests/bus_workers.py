"""Workers for the bus-pressure tests (tests/test_no_loss.py) and `make stress`."""

from __future__ import annotations

import os

from reactor_dist import DistributedWorker


class CountLoads(DistributedWorker):
    """Writes one line per load() to ``<log_dir>/loads`` (when given); generate(x)
    returns len(x) for bytes (a big input, a small reply), else x."""

    def load(self, log_dir: str | None = None) -> None:
        if log_dir:
            with open(os.path.join(log_dir, "loads"), "a") as f:
                f.write(f"load {self.rank}\n")

    def generate(self, x, /):
        return len(x) if isinstance(x, bytes) else x
