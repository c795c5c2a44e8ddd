"""Workers of test_staging.py: rank 0 returns (or yields) tensors of every kind; every
rank copies its input with ``to_device`` and reports how it went."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch
from probe import rank_memory_of

from reactor_dist import DistributedWorker

MB = 1 << 20


@dataclasses.dataclass
class Frames:
    frames: Any
    note: str


def made(kind: str, step: int) -> Any:
    """The tensor of ``kind`` for call ``step``: the same on every rank and in the test."""
    g = torch.Generator().manual_seed(step)
    if kind == "uint8":
        return torch.randint(0, 256, (3, 512, 1024), dtype=torch.uint8, generator=g)
    if kind == "bfloat16":
        return torch.randn(2, MB, generator=g).to(torch.bfloat16)
    if kind == "float8":
        return torch.randn(2 * MB, generator=g).to(torch.float8_e4m3fn)
    if kind == "bool":
        return torch.rand(2 * MB, generator=g) > 0.5
    if kind == "transposed":
        return torch.randn(1024, 768, generator=g).t()
    if kind == "conj":  # a conjugate view: the conjugation is a bit on the tensor
        return torch.randn(MB, dtype=torch.complex64, generator=g).conj()
    if kind == "neg":  # a negative view, as x.conj().imag makes one
        return torch._neg_view(torch.randn(2 * MB, generator=g))
    if kind == "small":
        return torch.randn(64, 64, generator=g)
    raise ValueError(kind)


class Staged(DistributedWorker):
    """``generate((how, kinds, step))``: the tensors of ``kinds`` for ``step``, returned
    bare (one), in a dataclass, a dict, a list, or yielded one by one; with how "numpy",
    a 9 MiB numpy array made from a tensor; with how "staged", how many tensors rank 0
    staged so far (``kinds`` unused by both)."""

    def load(self) -> None:
        pass

    def generate(self, request, /):
        how, kinds, step = request
        tensors = [made(kind, step) for kind in kinds]
        if how == "bare":
            return tensors[0]
        if how == "dataclass":
            return Frames(tensors[0], "frames")
        if how == "dict":
            return {kind: t for kind, t in zip(kinds, tensors, strict=True)}
        if how == "list":
            return tensors
        if how == "numpy":  # .cpu().numpy() of 9 MiB, as a user would write it
            return torch.full((9 * MB,), step, dtype=torch.uint8).cpu().numpy()
        if how == "stream":
            return (t for t in tensors)
        if how == "staged":  # how many tensors rank 0 staged so far
            return rank_memory_of(self).result_staging.staged
        if how == "resolved":  # how many conjugate or negative views it made plain
            return rank_memory_of(self).result_staging.resolved
        raise ValueError(how)

    def reset(self) -> None:
        pass


class Inputs(DistributedWorker):
    """``generate((x, write))``: ``to_device(x)`` after writing ``write`` at x's start
    (None: no write); returns what it copied as numpy, and how many copies took the
    registered mapping so far."""

    def load(self) -> None:
        pass

    def generate(self, request, /):
        x, write = request
        if write is not None:
            x.reshape(-1)[:len(write)] = write
        copied = self.to_device(x)
        memory = rank_memory_of(self)
        return np.array(copied.numpy()), memory.input_staging.fast, self.rank

    def reset(self) -> None:
        pass
