"""The worker and steps of the pipelining tests (tests/test_pipeline.py).

``Recorder`` writes one line per call to ``<log_dir>/rank<N>.log`` as the rank starts it
(the step's ``label`` or class name, or ``repr`` of a plain input), so a test reads the
order in which each rank ran the calls; then it runs the step (sample_workers.Step) or
echoes the input.
"""

from __future__ import annotations

import dataclasses
import os
import time

from sample_workers import Echo, Step, hang


class Recorder(Echo):
    """Echo that records, on every rank, each call in the order the rank started it."""

    def generate(self, x, /):
        self.log(getattr(x, "label", type(x).__name__) if isinstance(x, Step) else repr(x))
        return x.run(self) if isinstance(x, Step) else x


def calls_seen(log_dir: str, rank: int) -> list[str]:
    """The lines Recorder wrote on ``rank``: one per call, in the order it ran them."""
    path = os.path.join(log_dir, f"rank{rank}.log")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return f.read().splitlines()


@dataclasses.dataclass
class Nap(Step):
    """Sleep ``seconds`` on every rank, then return ``value``."""

    seconds: float
    value: object = None

    @property
    def label(self) -> str:
        return f"nap {self.value!r}"

    def run(self, worker):
        time.sleep(self.seconds)
        return self.value


@dataclasses.dataclass
class TimedNap(Nap):
    """Nap, returning ``(value, began, ended)``: the rank's ``time.monotonic()`` as its
    nap began and ended (one clock for every process of the machine)."""

    def run(self, worker):
        began = time.monotonic()
        time.sleep(self.seconds)
        return self.value, began, time.monotonic()


@dataclasses.dataclass
class RaiseOn(Step):
    """Sleep ``seconds``, then raise ``ValueError("boom on rank N")`` on ``rank`` (every
    rank when None); a rank not named returns None."""

    seconds: float
    rank: int | None = None

    @property
    def label(self) -> str:
        return f"raise on {self.rank}"

    def run(self, worker):
        time.sleep(self.seconds)
        if self.rank in (None, worker.rank):
            raise ValueError(f"boom on rank {worker.rank}")


@dataclasses.dataclass
class NapOn(Step):
    """Rank ``rank`` sleeps ``seconds``; every rank returns ``value`` (no collective)."""

    rank: int
    seconds: float
    value: object = None

    def run(self, worker):
        if worker.rank == self.rank:
            time.sleep(self.seconds)
        return self.value


@dataclasses.dataclass
class NapThenExit(Step):
    """Rank ``rank`` sleeps ``seconds`` and then leaves with os._exit(3) (its reply to
    the call before has long been written: a reply queued in ZeroMQ when a process
    _exits at once may never leave it); the others return None at once."""

    rank: int
    seconds: float

    def run(self, worker):
        if worker.rank == self.rank:
            time.sleep(self.seconds)
            os._exit(3)


@dataclasses.dataclass
class HangOn(Step):
    """Rank ``rank`` never returns; the others return None at once."""

    rank: int

    @property
    def label(self) -> str:
        return f"hang on {self.rank}"

    def run(self, worker):
        if worker.rank == self.rank:
            hang()


@dataclasses.dataclass
class Items(Step):
    """A generator step (a stream): yields 0 .. n-1, each ``pause`` seconds after the last."""

    n: int
    pause: float = 0.0

    @property
    def label(self) -> str:
        return f"items {self.n}"

    def run(self, worker):
        return self._items()

    def _items(self):
        for i in range(self.n):
            time.sleep(self.pause)
            yield i
