"""Streaming: how soon ``runner.stream(x)`` hands over a step's first item, against the
whole step and one item's compute, all measured in the same steps.

The step (``StreamWorker``, world_size 2, every rank computing): 8 times, about 10 ms of
compute (``ItemCompute``) written into a fresh 12 MB ``shared_empty`` buffer, then
yielded with the seconds rank 0's compute took. Time to first item is from
``runner.stream(n)`` to the first item in the caller's hands; the whole step runs until
the stream ends. The floor is rank 0's compute of that first item, timed in the rank in
the same step (for the whole step: its 8 computes added up), so the difference is what
the call and the hand-over of a 12 MB item cost. Target: first item ≤ one item's compute
+ 1 ms (a step without streaming hands over nothing before all 8 are done).

Two runners, timed in alternating blocks: with the default pool (``keep_free_segments=2``)
and with ``keep_free_segments=8``. The caller lets go of each item at once, but rank 0
hears of it only with the next call, so a step of 8 items takes 8 segments; by default
the next call keeps 2 of them warm and retires 6, so every step creates 6 fresh 12 MB
segments (``posix_fallocate`` and a populated mapping on both sides) and the caller
unmaps 6 when the step's first item arrives. With one warm segment per item, none of
that happens.
"""

from __future__ import annotations

import gc
import time

from benchmarks.config import Settings
from benchmarks.implementations.pools import OURS
from benchmarks.report.results import FLOOR, Results, Row
from benchmarks.report.stats import summarize

WORLD_SIZE = 2
TARGET_S = 1e-3  # above one item's compute
FIRST, WHOLE = "stream first item", "stream whole step"
DEFAULT_POOL, WARM_POOL = f"{OURS} keep_free_segments=2", f"{OURS} keep_free_segments=items"


class StreamRunner:
    """``DistributedRunner(StreamWorker, world_size=2)``, started, without a process group
    (the transfer of the stream is what is measured)."""

    def __init__(self, s: Settings, keep_free_segments: int) -> None:
        from benchmarks.implementations.bench_workers import StreamWorker
        from reactor_dist import DistributedRunner

        self.items, self.nbytes = s.stream_items, s.stream_item_bytes
        self.runner = DistributedRunner(
            StreamWorker, world_size=WORLD_SIZE, init_process_group=False, device="cpu",
            load_kwargs={"item_bytes": s.stream_item_bytes, "reps": s.stream_reps},
            keep_free_segments=keep_free_segments, call_timeout=120.0, start_timeout=120.0)
        try:
            self.runner.start()
        except BaseException:
            self.runner.shutdown()
            raise

    def step(self) -> tuple[float, float, float, float]:
        """One streamed step: seconds to the first item, to the stream's end, rank 0's
        compute of the first item and of all items. Each item is checked and dropped
        before the next, as a consumer would."""
        t0 = time.perf_counter()
        first = None
        computes: list[float] = []
        for item, seconds in self.runner.stream(self.items):
            if first is None:
                first = time.perf_counter() - t0
            n = len(computes)
            if item.shape != (self.nbytes,) or item.flat[0] != n:
                raise RuntimeError(f"item {n}: wrong item {item.shape} {item.flat[0]}")
            computes.append(seconds)
            del item
        whole = time.perf_counter() - t0
        if len(computes) != self.items or first is None:
            raise RuntimeError(f"the stream gave {len(computes)} items, not {self.items}")
        return first, whole, computes[0], sum(computes)

    def close(self) -> None:
        self.runner.shutdown()


def measure(settings: Settings, results: Results) -> None:
    s = settings
    runners: dict[str, StreamRunner] = {}
    try:
        runners[DEFAULT_POOL] = StreamRunner(s, 2)
        runners[WARM_POOL] = StreamRunner(s, s.stream_items)
        for _ in range(s.stream_warmup):
            for runner in runners.values():
                runner.step()
        gc.collect()
        trials: dict[str, list[tuple[float, float, float, float]]] = {k: [] for k in runners}
        block = max(1, -(-s.stream_steps // s.stream_rounds))
        keys = list(runners)
        for r in range(s.stream_rounds):
            for key in keys if r % 2 == 0 else keys[::-1]:
                trials[key] += [runners[key].step() for _ in range(block)]
    finally:
        for runner in runners.values():
            runner.close()
    for key, steps in trials.items():
        first, whole, compute, computes = zip(*steps, strict=True)
        results.put(FIRST, "ws2", key, summarize(first))
        results.put(WHOLE, "ws2", key, summarize(whole))
        results.put(FIRST, "ws2", f"{key} {FLOOR}", summarize(compute))
        results.put(WHOLE, "ws2", f"{key} {FLOOR}", summarize(computes))


def rows(results: Results, settings: Settings) -> list[Row]:
    s = settings
    mb = s.stream_item_bytes / 1e6
    section = f"Streaming ({s.stream_items} items of {mb:g} MB, world_size {WORLD_SIZE})"
    label = ("rank 0's compute of the first item, timed in the rank in the same steps; "
             f"for the whole step, of all {s.stream_items} items")
    out = []
    for key, pool in ((WARM_POOL, f"keep_free_segments={s.stream_items}"),
                      (DEFAULT_POOL, "default keep_free_segments=2")):
        compute = results.get(FIRST, "ws2", f"{key} {FLOOR}")
        first = Row(section=section, case=f"stream(): time to first item, {pool}", unit="ms",
                    ours=results.get(FIRST, "ws2", key), floor=compute, floor_label=label,
                    target="≤ compute + 1 ms")
        if first.ours is not None and compute is not None:
            extra = first.ours.median - compute.median
            first.target = f"≤ compute + 1 ms (+{extra * 1e3:.2f} ms)"
            first.met = extra <= TARGET_S
        whole = Row(section=section, case=f"stream(): whole step, {pool}", unit="ms",
                    ours=results.get(WHOLE, "ws2", key),
                    floor=results.get(WHOLE, "ws2", f"{key} {FLOOR}"), floor_label=label)
        if first.ours is not None and whole.ours is not None:
            whole.target = (f"(info: first item at {first.ours.median / whole.ours.median:.0%}"
                            " of the step)")
        out += [first, whole]
    return out
