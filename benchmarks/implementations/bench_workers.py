"""Workers the benchmarks run under our runner; module level so a fresh interpreter
(each rank) can import them by name."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from benchmarks.implementations.workload import BenchModel, ItemCompute
from reactor_dist import DistributedWorker


class BenchWorker(DistributedWorker):
    """Runs ``BenchModel``, the same step the baselines run (see ``workload.py``).

    ``pid_dir``: each rank writes its pid to ``<pid_dir>/rank<N>.pid`` in ``load()``, so
    the failure benchmark knows which process to SIGKILL.
    """

    def load(self, *, result_shapes: list[tuple[int, ...]] = (),  # type: ignore[assignment]
             pid_dir: str | None = None, **_: Any) -> None:
        self.model = BenchModel(self.rank, result_shapes)
        if pid_dir is not None:
            path = os.path.join(pid_dir, f"rank{self.rank}.pid")
            with open(path + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.replace(path + ".tmp", path)  # the reader never sees a half-written pid

    def generate(self, input: Any, /) -> Any:
        return self.model.step(input, self.shared_empty)

    def reset(self) -> None:
        pass


class TorchWorker(DistributedWorker):
    """What start-up costs for a real model's worker before its weights: torch, and the
    process group proven usable by one collective."""

    def load(self, **_: Any) -> None:
        import torch
        import torch.distributed as dist

        t = torch.ones(1)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(t)
        self.ready = float(t.item())

    def generate(self, input: Any, /) -> Any:
        return None

    def reset(self) -> None:
        pass


class EchoWorker(DistributedWorker):
    """Returns its input: the plain user's loop of the per-call benchmark."""

    def generate(self, input: Any, /) -> Any:
        return input


class StreamWorker(DistributedWorker):
    """A generator step: ``items`` times, compute (:class:`ItemCompute`) into a fresh
    ``shared_empty`` buffer of ``item_bytes`` and yield it with the seconds that compute
    took here, so the caller knows each item's compute from the same step. Every rank
    computes (the way a model-parallel step keeps every rank busy); rank 0's items reach
    the caller."""

    def load(self, *, item_bytes: int, reps: int, **_: Any) -> None:
        self.item_bytes = item_bytes
        self.compute = ItemCompute(reps)

    def generate(self, items: int, /) -> Iterator[tuple[np.ndarray, float]]:
        for i in range(items):
            buf = self.shared_empty((self.item_bytes,), np.uint8)
            t0 = time.perf_counter()
            self.compute(buf, i)
            yield buf, time.perf_counter() - t0

    def reset(self) -> None:
        pass


class ItemsWorker(DistributedWorker):
    """``generate(n)``: rank 0 yields the numbers 0 .. n-1, one small item each, and every
    rank ends its step: what one stream item costs, against one bus message."""

    def generate(self, items: int, /) -> Iterator[int]:
        if self.rank == 0:
            yield from range(items)


class StepWorker(DistributedWorker):
    """A model step of ``seconds``, slept: a GPU step keeps the device busy and leaves the
    rank's CPU (and the caller's) free, which a sleep models and a busy loop would not.
    Returns the seconds it actually took, so the bound is measured, not assumed."""

    def generate(self, seconds: float, /) -> float:
        t0 = time.perf_counter()
        time.sleep(seconds)
        return time.perf_counter() - t0

    def reset(self) -> None:
        pass
