"""Summaries of repeated trials: a median alone hides the tail a user will hit."""

from __future__ import annotations

import gc
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Stats:
    """Seconds per trial, summarised; keeps the raw samples for the plots."""

    samples: tuple[float, ...]

    @property
    def n(self) -> int:
        return len(self.samples)

    def pct(self, q: float) -> float:
        return float(np.percentile(self.samples, q))

    median = property(lambda self: self.pct(50))
    p10 = property(lambda self: self.pct(10))
    p90 = property(lambda self: self.pct(90))
    p99 = property(lambda self: self.pct(99))


def summarize(samples: Sequence[float]) -> Stats:
    if not samples:
        raise ValueError("no samples")
    return Stats(tuple(float(s) for s in samples))


def time_calls(fn: Callable[[], object], *, n: int, warmup: int) -> Stats:
    """Time ``fn`` n times after ``warmup`` untimed calls.

    The result of each call is dropped before the next one starts, so that pools which
    recycle memory once the caller lets go are measured in their steady state. The
    garbage collector stays on (its pauses are part of what a caller pays and show in
    p99); it is only emptied once before the loop so earlier benchmarks don't leak in.
    """
    for _ in range(warmup):
        out = fn()
        del out
    gc.collect()
    samples: list[float] = []
    record_calls(fn, n, samples)
    return summarize(samples)


def alternate_blocks(blocks: dict[str, Callable[[int, list[float]], None]], *, calls: int,
                     warmup: int, rounds: int) -> dict[str, list[float]]:
    """Samples of each block, timed in alternating blocks (the order flipping every round)
    after ``warmup`` untimed calls each; ``blocks[k](n, into)`` times n calls into ``into``."""
    for run in blocks.values():
        run(warmup, [])
    gc.collect()
    samples: dict[str, list[float]] = {k: [] for k in blocks}
    size = max(1, -(-calls // rounds))
    for r in range(rounds):
        for key in (list(blocks) if r % 2 == 0 else list(blocks)[::-1]):
            blocks[key](size, samples[key])
    return samples


def paired_calls(fns: dict[str, Callable[[], object]], *, calls: int, warmup: int,
                 seed: int = 0) -> dict[str, list[float]]:
    """Samples of two kinds of call in ``calls`` pairs, one of each, in an order drawn
    per pair (seeded): the i-th sample of each ran next to the other's
    (:func:`median_pair_difference`).  A fixed order (each first in every other pair, as
    :func:`alternate_blocks` does) aliases with a period of the runner's own: two
    identical kinds read +3 to +11 µs apart that way on a ~570 µs call, ±2 µs this way."""
    (a, fn_a), (b, fn_b) = fns.items()
    for _ in range(warmup):
        fn_a()
        fn_b()
    gc.collect()
    samples: dict[str, list[float]] = {a: [], b: []}
    order = random.Random(seed)
    for _ in range(calls):
        pair = ((a, fn_a), (b, fn_b)) if order.random() < 0.5 else ((b, fn_b), (a, fn_a))
        for key, fn in pair:
            record_calls(fn, 1, samples[key])
    return samples


def median_pair_difference(ours: Stats, without: Stats) -> float:
    """The median of ``ours[i] - without[i]`` (seconds), for samples taken in pairs
    (:func:`paired_calls`): a speed the machine keeps for a while (a gloo transfer's is
    one of two for hundreds of calls here) cancels out of each pair, where it moves two
    medians apart."""
    n = min(ours.n, without.n)
    return float(np.median(np.subtract(ours.samples[:n], without.samples[:n])))


def record_calls(fn: Callable[[], object], count: int, into: list[float]) -> None:
    """Append the seconds each of ``count`` calls of ``fn`` took; each result is dropped
    before the next call."""
    for _ in range(count):
        t0 = time.perf_counter()
        out = fn()
        t1 = time.perf_counter()
        del out
        into.append(t1 - t0)


def interleave(
    fns: dict[str, Callable[[], object]],
    n: dict[str, int],
    *,
    warmup: dict[str, int],
    rounds: int,
    failed: Callable[[str, BaseException], None],
) -> dict[str, Stats]:
    """Time several implementations of one workload in alternating blocks.

    The machine's load drifts (other processes, frequency, page cache); measuring one
    implementation after the other would fold that drift into their ratio. Here each
    round runs a block of every implementation in turn, so drift hits all alike, and
    the order flips every round, so that none always follows the same other one. A
    function that raises is reported through ``failed`` and left out from then on.
    """
    live = dict(fns)
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for key in list(live):
        try:
            for _ in range(warmup.get(key, 0)):
                out = live[key]()
                del out
        except Exception as exc:
            failed(key, exc)
            del live[key]
    gc.collect()
    for i in range(rounds):
        order = list(live) if i % 2 == 0 else list(live)[::-1]
        for key in order:
            if key not in live:
                continue
            block = max(1, -(-n[key] // rounds))
            try:
                record_calls(live[key], block, samples[key])
            except Exception as exc:
                failed(key, exc)
                del live[key]
    return {k: summarize(v) for k, v in samples.items() if v and k in live}


def on_and_off(worker_cls: type, world_size: int, on: str, off: str, *, calls: int,
               warmup: int) -> dict[str, Stats]:
    """A runner of ``worker_cls`` (CPU, its gloo group) whose ``generate(flag)`` runs with
    a feature (True) or without it (False), timed in pairs of one call each
    (:func:`paired_calls`, for :func:`median_pair_difference`): each one's samples,
    summarised, as ``on`` and ``off``."""
    from reactor_dist import DistributedRunner

    runner = DistributedRunner(worker_cls, world_size=world_size, device="cpu",
                               call_timeout=120.0)
    runner.start()
    try:
        samples = paired_calls({on: lambda: runner.generate(True),
                                off: lambda: runner.generate(False)},
                               calls=calls, warmup=warmup)
    finally:
        runner.shutdown()
    return {key: summarize(v) for key, v in samples.items()}
