"""Workers whose collectives go wrong on purpose (issue 45): each ``generate(case)`` makes
two ``all_reduce`` calls of 4 float32 on every rank but the last, which does what
``case`` says: "ok" the same, "skip" leaves out the second, "shape" passes 8 elements
to the first, "kind" calls ``broadcast`` in place of the first; "die" has the last rank
SIGKILL itself inside the first while rank 0 is late to it; "kind_raise" is "kind" with
``async_op=True`` and a 1 s ``wait()``, so that every rank raises the same error."""

from __future__ import annotations

import os
import signal
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from reactor_dist import DistributedWorker


class Collectives(DistributedWorker):
    def load(self) -> None:
        pass

    def generate(self, case: str) -> int:
        last = self.rank == self.world_size - 1
        x = torch.ones(4, device=self.device)
        if last and case == "shape":
            dist.all_reduce(torch.ones(8, device=self.device))
        elif last and case == "kind":
            dist.broadcast(x, src=0)
        elif case == "kind_raise":
            work = dist.broadcast(x, src=0, async_op=True) if last else \
                dist.all_reduce(x, async_op=True)
            work.wait(timeout=timedelta(seconds=1))
        elif last and case == "die":
            threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGKILL)).start()
            dist.all_reduce(x)
        else:
            if case == "die" and self.rank == 0:
                time.sleep(5)
            dist.all_reduce(x)
        if not (last and case == "skip"):
            dist.all_reduce(x)
        return int(x.sum())

    def environment(self, name: str) -> str | None:
        """A variable of this rank's environment (what the runner set in it)."""
        return os.environ.get(name)
