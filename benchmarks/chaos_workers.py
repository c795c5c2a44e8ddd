"""The worker ``make chaos`` (benchmarks/chaos.py) drives, importable by its ranks.

Every answer is a function of the input alone, and wrong if two calls' collectives
paired up: for item ``i`` of a call with ``tag`` and ``value`` each rank all_reduces
``[tag, value * (rank + 1), i]``, so rank 0 must hand out
``[W * tag, value * W (W + 1) / 2, W * i]`` (``expected``).  A call of another tag, or
another item of the same call, on any rank shows in that sum.  Tags are unique per call.

The input is a dict: ``tag``, ``value``, ``items`` (None: one result; n: a stream of n
items), ``work`` (seconds each rank sleeps before each collective), and ``fault``
(None, or ``{"rank": r or "all", "means": ..., "where": ..., "item": k}``) which the
rank(s) fire at item ``k``, "before_collective" or "after_collective" (after the
all_reduce, before the item is handed out).  ``means``: "raise" (InjectedError),
"desync" (rank ``r`` raises OtherInjectedError, every other rank InjectedError: two
types), "exit" (``os._exit(3)``), "hang" (sleeps until killed).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

from reactor_dist import DistributedWorker


class InjectedError(Exception):
    """The exception a "raise" fault raises (on one rank, or on all)."""


class OtherInjectedError(Exception):
    """What the named rank raises in a "desync" fault, while the others raise
    InjectedError: ranks raising different types."""


def expected(world_size: int, tag: int, value: int, item: int) -> list[float]:
    """What rank 0 must hand out for item ``item`` of the call ``(tag, value)``."""
    return [float(world_size * tag), float(value * world_size * (world_size + 1) // 2),
            float(world_size * item)]


def fires_here(fault: dict | None, rank: int, item: int, where: str) -> bool:
    """Whether this rank fires ``fault`` now (shared with the harness's judge)."""
    if fault is None or fault["item"] != item or fault["where"] != where:
        return False
    return fault["means"] == "desync" or fault["rank"] in ("all", rank)


def fire(fault: dict, rank: int) -> None:
    means = fault["means"]
    if means == "exit":
        os._exit(3)
    if means == "hang":
        while True:  # until the runner gives up on it and ends the process
            time.sleep(0.1)
    if means == "desync" and fault["rank"] == rank:
        raise OtherInjectedError(f"desync: rank {rank} raises another type")
    raise InjectedError(f"{means} on rank {rank}")


class ChaosWorker(DistributedWorker):
    """Reduces every item over the torch group; fires the input's fault.  No rejoin():
    a restart starts every rank again."""

    def load(self) -> None:
        self.calls = 0  # session state, dropped by rejoin()

    def generate(self, x: dict, /) -> Any:
        self.calls += 1
        if x["items"] is None:
            return self.item(x, 0)
        return self.items(x)

    def items(self, x: dict) -> Iterator[list[float]]:
        for i in range(x["items"]):
            yield self.item(x, i)

    def item(self, x: dict, i: int) -> list[float]:
        import torch
        import torch.distributed as dist

        fault = x["fault"]
        if x["work"]:
            time.sleep(x["work"])
        if fires_here(fault, self.rank, i, "before_collective"):
            fire(fault, self.rank)
        t = torch.tensor([x["tag"], x["value"] * (self.rank + 1), i], dtype=torch.float64)
        dist.all_reduce(t)
        if fires_here(fault, self.rank, i, "after_collective"):
            fire(fault, self.rank)
        return t.tolist()

    def reset(self) -> None:
        self.calls = 0


class ChaosRejoins(ChaosWorker):
    """ChaosWorker with rejoin(): the ranks that are fine keep their process."""

    def rejoin(self) -> None:
        self.calls = 0  # the failed session's state; the group is new and works
