"""Workers for the session tests (tests/test_sessions.py).

``Rollout`` is a deterministic rollout whose every step depends on all before it, on
every rank: each rank holds a state of ``SIZE`` float64 (large enough to cross through
shared memory), a step first adds its input to it (the state is half advanced here),
then all_reduces the first four values over every rank and folds the sum back in.  Rank
0 returns its state after the step.  :func:`reference` computes the same rollout in the
test's process, for any world size, so an uninterrupted run needs no runner.

An input ``Die(x, rank, marker)`` makes that rank SIGKILL itself in the step, after it
advanced its state half and before the all_reduce the others wait in, once: it creates
``marker`` first, so that the replay and the retry of that very call go through.  It
dies 0.2 s into the step, as a real fault comes partway through one: a rank killed
within microseconds of its previous reply can take that reply with it (still in its
zmq I/O thread), and a snapshot's reply lost so makes that snapshot incomplete (the
restart then goes back to the one before it).  Each
``load()`` and ``rejoin()`` appends the pid to ``<state_dir>/load-<rank>`` or
``rejoin-<rank>`` (a spare's load: ``load-spare``).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import numpy as np

from reactor_dist import DistributedWorker

SIZE = 16384  # float64s: 128 KiB, above the inline limit


@dataclasses.dataclass
class Die:
    x: float
    rank: int
    marker: str


def step(states: list[np.ndarray], x: float) -> None:
    """One step of every rank's state (index = rank), in place."""
    for rank, state in enumerate(states):
        state += x * (rank + 1)
    total = sum(state[:4] for state in states).sum()
    for state in states:
        state *= 0.5
        state += total


def reference(xs: list[float], world_size: int, reset_after: int | None = None
              ) -> list[np.ndarray]:
    """Rank 0's result after each step of ``xs`` (a reset() after step ``reset_after``)."""
    states = [np.zeros(SIZE) for _ in range(world_size)]
    results = []
    for index, x in enumerate(xs):
        step(states, x)
        results.append(states[0].copy())
        if reset_after is not None and index == reset_after:
            for state in states:
                state[:] = 0.0
    return results


def record(state_dir: str | None, what: str, rank: int | None) -> None:
    if state_dir:
        name = "spare" if rank is None else rank
        with open(os.path.join(state_dir, f"{what}-{name}"), "a") as f:
            f.write(f"{os.getpid()}\n")


class Rollout(DistributedWorker):
    """Without rejoin(): a restart gives every rank a new process."""

    def load(self, state_dir: str | None = None) -> None:
        self.state_dir = state_dir
        self.state = np.zeros(SIZE)
        self.restored = 0
        record(state_dir, "load", self.rank)

    def generate(self, x):
        import torch
        import torch.distributed as dist

        die = x if isinstance(x, Die) else None
        x = die.x if die is not None else x
        self.state += x * (self.rank + 1)
        if die is not None and die.rank == self.rank and not os.path.exists(die.marker):
            open(die.marker, "w").close()
            time.sleep(0.2)
            os.kill(os.getpid(), signal.SIGKILL)
        head = torch.from_numpy(self.state[:4].copy())
        if self.world_size > 1:
            dist.all_reduce(head)
        self.state *= 0.5
        self.state += float(head.sum())
        return self.state.copy()

    def reset(self) -> None:
        self.state[:] = 0.0

    def snapshot(self):
        return {"state": self.state, "restored": self.restored}

    def restore(self, saved) -> None:
        self.state = saved["state"]
        self.restored = saved["restored"] + 1


class RejoiningRollout(Rollout):
    """With rejoin(): survivors keep their process (and a spare can take a place)."""

    def rejoin(self) -> None:
        record(self.state_dir, "rejoin", self.rank)


class Streaming(RejoiningRollout):
    """generate(x) yields three items: the state after the step, +1 and +2, with an
    all_reduce before each of the last two.  ``Die`` here kills its rank after the first
    item (0.3 s later: it has reached the caller), while rank 0 waits in the
    all_reduce."""

    def generate(self, x):
        import torch
        import torch.distributed as dist

        die = x if isinstance(x, Die) else None
        state = super().generate(die.x if die is not None else x)
        yield state
        for k in (1, 2):
            if die is not None and die.rank == self.rank and not os.path.exists(die.marker):
                open(die.marker, "w").close()
                time.sleep(0.3)
                os.kill(os.getpid(), signal.SIGKILL)
            dist.all_reduce(torch.ones(1))
            yield state + k


class Noisy(RejoiningRollout):
    """Unseeded noise in every step: a replay gives another result."""

    def generate(self, x):
        super().generate(x)
        self.state += np.random.default_rng().random()
        return self.state.copy()


class NoHooks(DistributedWorker):
    def generate(self, x):
        return x


class SnapshotRaises(RejoiningRollout):
    """snapshot() raises on every rank at the ``at``-th snapshot (1: the one at start())."""

    def load(self, state_dir: str | None = None, at: int = 1) -> None:
        super().load(state_dir)
        self.at, self.snapshots = at, 0

    def snapshot(self):
        self.snapshots += 1
        if self.snapshots == self.at:
            raise OSError(f"snapshot {self.at} failed")
        return super().snapshot()


class RestoreRaises(RejoiningRollout):
    def restore(self, saved) -> None:
        raise OSError("restore failed")


@dataclasses.dataclass
class DieAlways:
    """Rank ``rank`` SIGKILLs itself in every call with this input."""

    rank: int


class Dies(RejoiningRollout):
    def generate(self, x):
        if isinstance(x, DieAlways):
            if x.rank == self.rank:
                os.kill(os.getpid(), signal.SIGKILL)
            x = 0.0
        return super().generate(x)


class FrameRollout(RejoiningRollout):
    """generate(frame): a step whose input is an array of SIZE float64 (through shared
    memory), added to the state as it is, then the rollout's step with x = 0."""

    def generate(self, frame):
        die = frame if isinstance(frame, Die) else None
        self.state += die.x if die is not None else frame
        return super().generate(Die(0.0, die.rank, die.marker) if die is not None else 0.0)


def frame_reference(frames: list[np.ndarray], world_size: int) -> list[np.ndarray]:
    states = [np.zeros(SIZE) for _ in range(world_size)]
    results = []
    for frame in frames:
        for state in states:
            state += frame
        step(states, 0.0)
        results.append(states[0].copy())
    return results
