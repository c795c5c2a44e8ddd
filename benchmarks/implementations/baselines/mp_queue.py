"""Baseline (b): a ``multiprocessing`` spawn pool, one request ``Queue`` and one reply
``Queue`` per rank, payloads pickled by the queues (what a runner of this kind does)."""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
import traceback
from multiprocessing.process import BaseProcess

from benchmarks.implementations.procs import ClosesOnExit
from benchmarks.implementations.workload import BenchModel

_STOP = "__stop__"


def _serve(rank: int, result_shapes: list[tuple[int, ...]], req: mp.Queue, rep: mp.Queue) -> None:
    model = BenchModel(rank, result_shapes)
    rep.put(("ready", None))
    while True:
        inp = req.get()
        if isinstance(inp, str) and inp == _STOP:
            break
        try:
            rep.put(("ok", model.step(inp)))
        except Exception as exc:
            rep.put(("err", f"{exc!r}\n{traceback.format_exc()}"))


class MpQueuePool(ClosesOnExit):
    name = "mp-queue"
    supports_shared = False

    def __init__(self, world_size: int, result_shapes: list[tuple[int, ...]],
                 reply_timeout_s: float = 120.0) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.timeout = reply_timeout_s
        self.req = [ctx.Queue() for _ in range(world_size)]
        self.rep = [ctx.Queue() for _ in range(world_size)]
        self.procs: list[BaseProcess] = []
        try:
            for rank in range(world_size):
                p = ctx.Process(target=_serve, args=(rank, result_shapes, self.req[rank],
                                                     self.rep[rank]), daemon=True)
                p.start()
                self.procs.append(p)
            for rank in range(world_size):
                self._get(rank)
        except BaseException:
            self.close()
            raise

    def generate(self, inp: object) -> object:
        for q in self.req:
            q.put(inp)
        replies = [self._get(rank) for rank in range(self.world_size)]
        for status, payload in replies:
            if status != "ok":
                raise RuntimeError(f"rank failed: {payload}")
        return replies[0][1]

    def _get(self, rank: int) -> tuple[str, object]:
        """A reply, or an error once the rank is dead or the timeout passed (no hang)."""
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                return self.rep[rank].get(timeout=0.5)
            except queue.Empty:
                if not self.procs[rank].is_alive():
                    raise RuntimeError(f"mp-queue rank {rank} died") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"mp-queue rank {rank} silent") from None

    def close(self) -> None:
        for q in self.req:
            try:
                q.put(_STOP)
            except (OSError, ValueError):
                pass
        for p in self.procs:
            p.join(timeout=2.0)
            if p.is_alive():
                p.kill()
                p.join()
        for q in (*self.req, *self.rep):
            # Drop anything unread so the feeder threads don't block interpreter exit.
            try:
                while True:
                    q.get_nowait()
            except (queue.Empty, OSError, ValueError):
                pass
            q.close()
            q.cancel_join_thread()
        # Dropping the queues unlinks their named semaphores from /dev/shm now, not at exit.
        self.req, self.rep, self.procs = [], [], []

