"""One interface over ours and the baselines, so every workload runs the same code on
each implementation and only the message path differs."""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from typing import Protocol

from benchmarks.implementations.baselines import JsonSubprocessPool, MpQueuePool

OURS = "reactor_dist"
JSON = JsonSubprocessPool.name
MPQ = MpQueuePool.name
IMPLEMENTATIONS = (OURS, JSON, MPQ)


class Pool(Protocol):
    name: str
    supports_shared: bool

    def generate(self, inp: object) -> object: ...
    def close(self) -> None: ...


class _RunnerPool:
    """A started ``DistributedRunner`` behind the pool interface (shut down if its start
    fails)."""

    name = OURS

    def _start(self, runner) -> None:
        self.runner = runner
        try:
            runner.start()
        except BaseException:
            runner.shutdown()
            raise

    def generate(self, inp: object) -> object:
        return self.runner.generate(inp)

    def close(self) -> None:
        self.runner.shutdown()


class OurPool(_RunnerPool):
    """``DistributedRunner`` around ``BenchWorker``, without torch.distributed (the
    message path is what is measured, not group formation)."""

    supports_shared = True

    def __init__(self, world_size: int, result_shapes: list[tuple[int, ...]]) -> None:
        from benchmarks.implementations.bench_workers import BenchWorker
        from reactor_dist import DistributedRunner

        self._start(DistributedRunner(
            BenchWorker, world_size=world_size, init_process_group=False,
            load_kwargs={"result_shapes": result_shapes}, call_timeout=120.0,
            start_timeout=120.0))


class EchoRunner(_RunnerPool):
    """What a user's plain loop runs: ``DistributedRunner(EchoWorker, world_size=N,
    init_process_group=False)``, a module-level worker that returns its input. The
    per-call benchmark times ``generate(1)`` on it."""

    supports_shared = False

    def __init__(self, world_size: int, result_shapes: list[tuple[int, ...]] = ()) -> None:
        from benchmarks.implementations.bench_workers import EchoWorker
        from reactor_dist import DistributedRunner

        self._start(DistributedRunner(EchoWorker, world_size=world_size,
                                      init_process_group=False, device="cpu",
                                      call_timeout=120.0, start_timeout=120.0))


FACTORIES: dict[str, Callable[[int, list[tuple[int, ...]]], Pool]] = {
    OURS: OurPool,
    JSON: JsonSubprocessPool,
    MPQ: MpQueuePool,
}


def open_pool(impl: str, world_size: int, result_shapes: list[tuple[int, ...]]) -> Pool:
    return FACTORIES[impl](world_size, result_shapes)


def open_all(impls: tuple[str, ...], world_size: int, result_shapes: list[tuple[int, ...]],
             notes: list[str]) -> dict[str, Pool]:
    """Every implementation of ``impls`` that starts; one that does not is noted."""
    pools: dict[str, Pool] = {}
    for impl in impls:
        try:
            pools[impl] = open_pool(impl, world_size, result_shapes)
        except Exception as exc:
            traceback.print_exc(file=sys.stderr)
            notes.append(f"{impl} world_size {world_size} did not start: {exc!r}")
    return pools


def close_all(pools: dict[str, Pool]) -> None:
    for pool in pools.values():
        pool.close()
