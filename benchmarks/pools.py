"""One interface over ours and the baselines, so every workload runs the same code on
each implementation and only the transport differs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from benchmarks.baselines import JsonSubprocessPool, MpQueuePool

OURS = "reactor_dist"
JSON = JsonSubprocessPool.name
MPQ = MpQueuePool.name
IMPLEMENTATIONS = (OURS, JSON, MPQ)


class Pool(Protocol):
    name: str
    supports_shared: bool

    def generate(self, inp: object) -> object: ...
    def close(self) -> None: ...


class OurPool:
    """``DistributedRunner`` around ``BenchWorker``, without torch.distributed (the
    transport is what is measured, not group formation)."""

    name = OURS
    supports_shared = True

    def __init__(self, world_size: int, result_shapes: list[tuple[int, ...]]) -> None:
        from benchmarks.bench_workers import BenchWorker
        from reactor_dist import DistributedRunner

        self.runner = DistributedRunner(
            BenchWorker, world_size=world_size, init_process_group=False,
            load_kwargs={"result_shapes": result_shapes}, call_timeout=120.0,
            start_timeout=120.0,
        )
        try:
            self.runner.start()
        except BaseException:
            self.runner.shutdown()
            raise

    def generate(self, inp: object) -> object:
        return self.runner.generate(inp)

    def close(self) -> None:
        self.runner.shutdown()


FACTORIES: dict[str, Callable[[int, list[tuple[int, ...]]], Pool]] = {
    OURS: OurPool,
    JSON: JsonSubprocessPool,
    MPQ: MpQueuePool,
}


def open_pool(impl: str, world_size: int, result_shapes: list[tuple[int, ...]]) -> Pool:
    return FACTORIES[impl](world_size, result_shapes)
