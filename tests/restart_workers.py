"""Workers for the restart tests (tests/test_restart.py).

``Reduces`` is deterministic and uses the group: ``generate(x)`` with a number all_reduces
``arange(4) * (rank + 1) + x`` over every rank, so a runner answers the same for the same
input whatever happened to it, if (and only if) every rank is back in one working group.
A dict input makes one rank fail at a chosen place (``FaultAt``); ``Arm`` leaves a
thread behind that fires a fault while the rank is idle.

Each ``load()`` and ``rejoin()`` appends ``<pid>`` to ``<state_dir>/load-<rank>`` or
``rejoin-<rank>``: the tests count them per process; with ``reload_seconds``, a load()
after the first of its rank (a replacement's, in a restart) sleeps that long once its
record is written (a test sees that the replacement is inside load()).  With
``load_fault`` set, load() fires that fault on the rank it names once the file
``marker`` exists (a fault during restart() itself: the test creates the marker after
start()).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time

from sample_workers import Step, inject_fault

from reactor_dist import DistributedWorker

STREAM_ITEMS = 4


def record(state_dir: str | None, what: str, rank: int) -> None:
    if state_dir:
        with open(os.path.join(state_dir, f"{what}-{rank}"), "a") as f:
            f.write(f"{os.getpid()}\n")


def fire(means: str, rank: int) -> None:
    """One fault, in this rank, now: SIGKILL, os._exit(3), a real SIGSEGV, a hang
    (SIGSTOP: the process cannot even answer a signal), or raising (a desync)."""
    if means == "hang":
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(3600)  # in case it is continued
    inject_fault({"phase": "restart-test", "rank": rank,
                  "means": {"desync": "raise", "sigkill": "sigkill"}.get(means, means)})


def reduced(x: float, rank: int) -> list[float]:
    import torch
    import torch.distributed as dist

    t = torch.arange(4, dtype=torch.float64) * (rank + 1) + x
    dist.all_reduce(t)
    return t.tolist()


@dataclasses.dataclass
class FaultAt:
    """Rank ``rank`` fires ``means`` at ``where``: "call" (the other ranks return without
    a collective), "collective" (the other ranks wait in an all_reduce for it) or
    "stream" (after item 1 of a stream of STREAM_ITEMS reduced items); means "raise_all":
    every rank raises ValueError."""

    means: str
    rank: int
    where: str


@dataclasses.dataclass
class Arm:
    """Rank ``rank`` starts a thread that fires ``means`` once ``trigger`` exists: a fault
    that happens while the rank is idle (in its serve loop)."""

    means: str
    rank: int
    trigger: str


@dataclasses.dataclass
class DieIn:
    """Rank ``victim`` is SIGKILLed ``when`` ("before": as the others enter the collective
    ``op``; "inside": 0.3 s after it entered ``op`` itself, while the rank after it is
    still a second from entering), ``op`` being all_reduce, all_gather or broadcast
    (from the victim) of ``n`` elements, on the CPU (gloo) or, ``on_device``, on the
    rank's device (a GPU's: NCCL)."""

    victim: int
    when: str
    op: str
    n: int
    on_device: bool = False


@dataclasses.dataclass
class BreakContext:
    """Each rank of ``ranks`` raises what torch raises once a kernel broke its process's
    CUDA context (``text``: the CUDA error, a sticky one by default); the others return.
    ``wrapped``: the model's own error, raised from that one."""

    ranks: tuple[int, ...]
    text: str = "CUDA error: an illegal memory access was encountered"
    wrapped: bool = False


@dataclasses.dataclass
class HangIn:
    """Rank ``rank`` hangs in the model's own code (a sleep, not a collective); the
    others return."""

    rank: int


@dataclasses.dataclass
class Pid:
    """Every rank's pid and how many times its worker object ran load() and rejoin()."""


class Reduces(DistributedWorker):
    def load(self, state_dir: str | None = None, load_fault: dict | None = None,
             reload_seconds: float = 0.0) -> None:
        self.state_dir = state_dir
        self.loads, self.rejoins = 1, 0
        again = bool(state_dir) and os.path.exists(os.path.join(state_dir, f"load-{self.rank}"))
        record(state_dir, "load", self.rank)
        if again and reload_seconds:  # a replacement's load() lasts: a restart takes a while
            time.sleep(reload_seconds)
        if load_fault and load_fault["rank"] == self.rank and \
                os.path.exists(load_fault["marker"]):
            inject_fault({"phase": "load", "rank": self.rank, "means": load_fault["means"]})

    def generate(self, x, /):
        if isinstance(x, FaultAt):
            return self.fault_at(x)
        if isinstance(x, Arm):
            if x.rank == self.rank:
                threading.Thread(target=self.fire_when, args=(x,), daemon=True).start()
            return "armed"
        if isinstance(x, Pid):
            return self.gather((os.getpid(), self.loads, self.rejoins))
        if isinstance(x, DieIn):
            return self.die_in(x)
        if isinstance(x, BreakContext):
            return self.break_context(x)
        if isinstance(x, HangIn):
            if x.rank == self.rank:
                time.sleep(3600)
            return "returned"
        if isinstance(x, Step):  # sample_workers.Sleep: a call that stays in flight a while
            return x.run(self)
        return reduced(x, self.rank)

    def gather(self, mine):
        import torch.distributed as dist

        every: list = [None] * self.world_size
        dist.all_gather_object(every, mine)
        return every

    def break_context(self, spec: BreakContext) -> str:
        import torch

        if self.rank in spec.ranks:
            error = torch.AcceleratorError(
                f"{spec.text}\nCUDA kernel errors might be asynchronously reported at some "
                f"other API call, so the stacktrace below might be incorrect.")
            if spec.wrapped:
                raise RuntimeError("the denoiser's step failed") from error
            raise error
        return "returned"

    def fault_at(self, spec: FaultAt):
        if spec.means == "raise_all":  # every rank, before any collective: fails alone
            raise ValueError(f"every rank raises (rank {self.rank})")
        if spec.where == "stream":
            return self.stream_then_fault(spec)
        if spec.rank == self.rank:
            fire(spec.means, self.rank)
        if spec.where == "collective":
            reduced(0, self.rank)
        return "done"

    def die_in(self, spec: DieIn) -> str:
        import torch
        import torch.distributed as dist

        t = torch.full((spec.n,), float(self.rank + 1),
                       device=self.device if spec.on_device else "cpu")
        if spec.on_device:
            torch.cuda.synchronize()
        if self.rank == spec.victim:
            if spec.when == "before":
                os.kill(os.getpid(), signal.SIGKILL)
            threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGKILL)).start()
        elif self.rank == (spec.victim + 1) % self.world_size and spec.when == "inside":
            time.sleep(1.0)
        if spec.op == "all_reduce":
            dist.all_reduce(t)
        elif spec.op == "all_gather":
            dist.all_gather([torch.empty_like(t) for _ in range(self.world_size)], t)
        else:
            dist.broadcast(t, src=spec.victim)
        if spec.on_device:  # NCCL returns at once: the wait is the stream's
            torch.cuda.synchronize()
        if self.rank == spec.victim:
            time.sleep(3600)  # the op returned before the timer: it fires here
        return "returned"

    def stream_then_fault(self, spec: FaultAt):
        for i in range(STREAM_ITEMS):
            if i == 2 and spec.rank == self.rank:
                fire(spec.means, self.rank)
            yield reduced(i, self.rank)

    def fire_when(self, spec: Arm) -> None:
        deadline = time.monotonic() + 60
        while not os.path.exists(spec.trigger) and time.monotonic() < deadline:
            time.sleep(0.01)
        fire(spec.means, self.rank)

    def reset(self) -> None:
        pass


class ReducesAndRejoins(Reduces):
    """Reduces, with the rejoin() hook: its survivors keep their process and worker."""

    def rejoin(self) -> None:
        self.rejoins += 1
        record(self.state_dir, "rejoin", self.rank)


class DiesOnEveryCall(DistributedWorker):
    """Rank 1 exits (os._exit(3)) in every generate(): a crash loop."""

    def load(self) -> None:
        pass

    def generate(self, x, /):
        if self.rank == 1:
            os._exit(3)
        return x

    def reset(self) -> None:
        pass


class SpareAware(ReducesAndRejoins):
    """ReducesAndRejoins that also appends, at each load() and rejoin(), what the worker
    saw to ``<state_dir>/seen``, one JSON list a line: what, pid, rank, is_spare,
    is_leader, whether torch.distributed had a group, the RANK and LOCAL_RANK variables
    (LOCAL_RANK: the GPU index a process holds)."""

    def load(self, **kwargs) -> None:
        super().load(**kwargs)
        self.saw("load")

    def rejoin(self) -> None:
        super().rejoin()
        self.saw("rejoin")

    def saw(self, what: str) -> None:
        import json
        import sys

        dist = sys.modules.get("torch.distributed")
        grouped = bool(dist is not None and dist.is_initialized())
        with open(os.path.join(self.state_dir, "seen"), "a") as f:
            f.write(json.dumps([what, os.getpid(), self.rank, self.is_spare, self.is_leader,
                                grouped, os.environ.get("RANK"),
                                os.environ.get("LOCAL_RANK")]) + "\n")


class SpareLoadRaises(ReducesAndRejoins):
    """A spare's load() (rank None) raises ValueError; the ranks' load fine."""

    def load(self, **kwargs) -> None:
        if self.rank is None:
            raise ValueError("this model cannot load without a rank")
        super().load(**kwargs)


class Alone(DistributedWorker):
    """World size 1 (no torch group): ``generate(x)`` is this process's pid and x, or
    BreakContext's error."""

    def generate(self, x, /):
        if isinstance(x, BreakContext):
            return Reduces.break_context(self, x)  # type: ignore[arg-type]
        return os.getpid(), x
