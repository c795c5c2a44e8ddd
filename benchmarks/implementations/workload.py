"""The stand-in model every implementation runs, so that ours and the baselines do the
same work per step and differ only in how the step reaches the ranks and comes back.

Inputs (the same Python objects are handed to every implementation):

- ``None``: an empty step; every rank returns ``None``.
- an ``int``: the plain loop's call; every rank returns it as it came.
- ``("plain", shape)``: rank 0 returns a uint8 array of that shape it allocated in
  ``load()`` and keeps (the model's output buffer), others ``None``.
- ``("shared", shape)``: rank 0 allocates the result with ``shared_empty`` on every
  call, writes its first and last byte and returns it (only ours has ``shared_empty``).
- an ``np.ndarray``: an input broadcast; every rank reads one byte and returns ``None``.
- ``("echo", array)``: the input comes back from rank 0 (input + result).
- ``("sleep", seconds)``: every rank sleeps, to measure hangs and crashes mid-call.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import numpy as np

SharedEmpty = Callable[[tuple[int, ...], "np.dtype | type"], np.ndarray]

PLAIN_FILL = 7  # what a plain result holds, so a caller can check the bytes arrived


class BenchModel:
    """One rank's state: rank 0 keeps one output buffer per result shape."""

    def __init__(self, rank: int, result_shapes: Iterable[tuple[int, ...]] = ()) -> None:
        self.rank = rank
        self.outputs: dict[tuple[int, ...], np.ndarray] = {}
        if rank == 0:
            for shape in result_shapes:
                # np.full, not np.empty: the pages must exist, as a model's output does.
                self.outputs[tuple(shape)] = np.full(tuple(shape), PLAIN_FILL, np.uint8)

    def step(self, inp: object, shared_empty: SharedEmpty | None = None) -> object:
        if inp is None:
            return None
        if type(inp) is int:
            return inp
        if isinstance(inp, np.ndarray):
            _ = inp.flat[0] if inp.size else None  # touch the input as a model would
            return None
        if not isinstance(inp, tuple) or len(inp) != 2:
            raise TypeError(f"unknown bench input {type(inp).__name__}")
        op, arg = inp
        if op == "sleep":
            time.sleep(float(arg))
            return None
        if self.rank != 0:
            return None
        if op == "plain":
            return self.outputs[tuple(arg)]
        if op == "shared":
            if shared_empty is None:
                raise TypeError("this implementation has no shared_empty")
            buf = shared_empty(tuple(arg), np.uint8)
            buf.flat[0] = PLAIN_FILL
            buf.flat[-1] = PLAIN_FILL
            return buf
        if op == "echo":
            return arg
        raise ValueError(f"unknown bench op {op!r}")


# -- streaming: a step that yields several big items with compute between them --------

WORK_SIZE = 131_072  # float64 values the compute works on (1 MB: stays in cache)


class ItemCompute:
    """One streamed item's work: ``reps`` passes of ``np.sin`` over a 1 MB working set,
    then the result written over the whole item buffer (as a model writes its output).

    Rank 0 times each call and sends the seconds with the item, so "one item's compute"
    is measured in the very step whose first item is timed, not assumed.
    """

    def __init__(self, reps: int) -> None:
        self.reps = reps
        self.x = np.empty(WORK_SIZE)

    def __call__(self, out: np.ndarray, index: int) -> np.ndarray:
        x = self.x
        x[:] = np.linspace(0.0, 1.0 + index, WORK_SIZE)
        for _ in range(self.reps):
            np.sin(x, out=x)
        out.fill(int(x[-1] * 100) % 256)
        out.flat[0] = index  # which item this is, for the caller's check
        return out
