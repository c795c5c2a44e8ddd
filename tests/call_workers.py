"""Workers of tests/test_call_by_name.py: methods called by name on every rank."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
from session_workers import RejoiningRollout

from reactor_dist import DistributedWorker


class Tunable(DistributedWorker):
    """``generate(x)``: x times this rank's gain, all_reduced over the group (every rank
    must hold the same gain, or the sum says so); methods that set the gain, report it,
    return an array per rank, raise, hang or die."""

    def load(self) -> None:
        self.gain = 1.0
        self.calls = []

    def generate(self, x, /):
        import torch
        import torch.distributed as dist

        total = torch.tensor([x * self.gain], dtype=torch.float64)
        if self.world_size > 1:
            dist.all_reduce(total)
        self.calls.append("generate")
        return float(total[0])

    def reset(self) -> None:
        self.calls.append("reset")

    def set_gain(self, gain: float, *, offset: float = 0.0):
        self.gain = gain + offset
        self.calls.append("set_gain")
        return self.rank, self.gain

    def history(self) -> list[str]:
        return list(self.calls)

    def frames(self, n: int) -> np.ndarray:
        """A shared-memory-sized array of this rank's number."""
        return np.full(n, self.rank, np.int64)

    def raise_on(self, ranks: list[int]) -> str:
        if self.rank in ranks:
            raise ValueError(f"no gain for rank {self.rank}")
        return "fine"

    def sleep_on(self, rank: int, seconds: float) -> None:
        if self.rank == rank:
            time.sleep(seconds)

    def die_on(self, rank: int) -> None:
        if self.rank == rank:
            os.kill(os.getpid(), signal.SIGKILL)


class GainedRollout(RejoiningRollout):
    """The session tests' rollout, with a gain every rank takes by name."""

    def set_gain(self, gain: float) -> None:
        self.state *= gain
