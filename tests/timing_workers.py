"""Workers for the timings tests: ranks that take known, different times."""

from __future__ import annotations

import time

from reactor_dist import DistributedWorker


class SlowRank(DistributedWorker):
    """Sleeps ``base`` seconds, ``extra`` more on rank ``slow`` (None: a balanced run)."""

    def load(self, slow: int | None = 1, base: float = 0.0, extra: float = 0.05) -> None:
        self.slow, self.base, self.extra = slow, base, extra

    def generate(self, x, /):
        time.sleep(self.base + (self.extra if self.rank == self.slow else 0.0))
        return x


class SlowSteps(DistributedWorker):
    """A generator worker: ``n`` items, each after ``pause`` seconds (twice on rank 1)."""

    def generate(self, spec: dict):
        for i in range(spec["n"]):
            time.sleep(spec["pause"] * (2 if self.rank == 1 else 1))
            yield i


class Raises(DistributedWorker):
    """Sleeps ``pause`` seconds, then raises on every rank."""

    def generate(self, pause: float):
        time.sleep(pause)
        raise ValueError("planned")


class RaisingSteps(DistributedWorker):
    """A generator worker: one item, then ``pause`` seconds, then it raises on every rank."""

    def generate(self, pause: float):
        yield 0
        time.sleep(pause)
        raise ValueError("planned")


class Talks(DistributedWorker):
    """Prints a line in load() and in each call; load() takes ``pause`` seconds."""

    def load(self, pause: float = 0.0) -> None:
        time.sleep(pause)
        print(f"loaded rank {self.rank}", flush=True)

    def generate(self, x, /):
        print(f"rank {self.rank} got {x}", flush=True)
        return x


class DiesInCall(DistributedWorker):
    """Rank 1 exits in its first call."""

    def generate(self, x, /):
        if self.rank == 1:
            import os

            os._exit(3)
        return x


class LoadsShards(DistributedWorker):
    """load() reports ``shards`` steps of progress, ``pause`` seconds apart."""

    def load(self, shards: int = 4, pause: float = 0.02) -> None:
        for done in range(1, shards + 1):
            time.sleep(pause)
            self.report_progress(done, shards, "shards")

    def generate(self, x, /):
        return x


class TorchImported(DistributedWorker):
    """Answers whether torch is imported in the rank; "steps": the same as 2 items."""

    def generate(self, x, /):
        import sys

        if x == "steps":
            return (("torch" in sys.modules) for _ in range(2))
        return "torch" in sys.modules

    def reset(self) -> None:
        pass


class SlowBeforeAllReduce(DistributedWorker):
    """Sleeps ``base`` seconds, ``extra`` more on rank ``slow`` (None: balanced), then
    all_reduces a tensor on its device: the others wait for the slow rank inside it.
    ``how``: "sync", "async" (async_op=True, then wait()), or "imported" (``from
    torch.distributed import all_reduce``).  ``spin_cycles`` (CUDA): the slow rank queues
    that much GPU work before the all_reduce instead of sleeping (a device-side straggler:
    every rank's host launches the all_reduce at once)."""

    def load(self, slow: int | None = 1, base: float = 0.0, extra: float = 0.02,
             how: str = "sync", spin_cycles: int = 0) -> None:
        import torch

        self.torch, self.how, self.spin = torch, how, spin_cycles
        self.slow, self.base, self.extra = slow, base, extra
        self.ones = torch.ones(4, device=self.device)

    def generate(self, x, /):
        import torch.distributed as dist

        time.sleep(self.base + (self.extra if self.rank == self.slow else 0.0))
        if self.spin and self.rank == self.slow:
            self.torch.cuda._sleep(self.spin)
        tensor = self.ones.clone()
        if self.how == "async":
            dist.all_reduce(tensor, async_op=True).wait()
        elif self.how == "imported":
            from torch.distributed import all_reduce

            all_reduce(tensor)
        else:
            dist.all_reduce(tensor)
        return float(tensor.sum().item()) + x
