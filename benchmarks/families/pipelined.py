"""Pipelined steps: how many steps per second an app gets when a rank computes C ms per
step and the app does W ms of its own work on each result (encoding, sending), against
the bound 1 / max(C, W) that overlapping the two allows.

The rank's step is a sleep (``StepWorker``): a GPU step keeps the device busy and leaves
the CPUs free, which a sleep models and a busy loop on a 2-core machine would not. The
app's work is a sleep too. World size 2, ``device="cpu"``, no process group. Three
loops, on one runner with ``max_in_flight=1`` and one with ``max_in_flight=2``:

- *generate, then work*: ``runner.generate(C)``, then the app's work; what a plain loop
  does (steps take C + W);
- *submit ahead*: ``runner.submit`` of step n+1 before the app's work on step n's
  result, with ``max_in_flight=1`` (step n+1 is sent only once step n is answered, so
  the ranks wait for that round trip every step) and with ``max_in_flight=2`` (step n+1
  is already queued on the ranks when step n ends). Goal: ≥ 0.9 of the bound.

A step's time is from the end of the app's work on one step to the end of its work on
the next; the first step of a block (the pipeline filling) is not counted. The floor
is, per step, the longer of the rank's measured sleep and the app's. The loops run in
alternating blocks, the order flipping every round. ``python -m benchmarks.pipelined
[--quick]`` (``make bench-pipelined``) runs this row alone.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

from benchmarks.config import Settings
from benchmarks.report.results import FLOOR, Results, Row
from benchmarks.report.stats import summarize

WORLD_SIZE = 2
GOAL = 0.9  # of the bound, with two in flight
METRIC = "pipelined step"
SEQUENTIAL = "generate, then work"
AHEAD_1 = "submit ahead, max_in_flight=1"
AHEAD_2 = "submit ahead, max_in_flight=2"
Step = tuple[float, float]  # (seconds this step took in the loop, max(C, W) measured)
Block = Callable[[float, float, int, list[Step]], None]


def start_runner(max_in_flight: int) -> Any:
    from benchmarks.implementations.bench_workers import StepWorker
    from reactor_dist import DistributedRunner

    runner = DistributedRunner(StepWorker, world_size=WORLD_SIZE, init_process_group=False,
                               device="cpu", max_in_flight=max_in_flight,
                               call_timeout=60.0, start_timeout=120.0)
    try:
        runner.start()
    except BaseException:
        runner.shutdown()
        raise
    return runner


def app_work(seconds: float) -> float:
    """The app's own work on a result (a sleep): the seconds it took."""
    t0 = time.perf_counter()
    time.sleep(seconds)
    return time.perf_counter() - t0


def generate_then_work(runner: Any) -> Block:
    def block(c: float, w: float, n: int, into: list[Step]) -> None:
        last = time.perf_counter()
        for _ in range(n):
            compute = runner.generate(c)
            work = app_work(w)
            now = time.perf_counter()
            into.append((now - last, max(compute, work)))
            last = now
    return block


def submit_ahead(runner: Any) -> Block:
    def block(c: float, w: float, n: int, into: list[Step]) -> None:
        pending = runner.submit(c)
        last = None
        for i in range(n + 1):  # the first step fills the pipeline: not counted
            ahead = runner.submit(c) if i < n else None  # step n+1, before the work on n
            compute = pending.result()
            work = app_work(w)
            now = time.perf_counter()
            if last is not None:
                into.append((now - last, max(compute, work)))
            last, pending = now, ahead
    return block


def measure(settings: Settings, results: Results) -> None:
    s = settings
    runners: dict[int, Any] = {}
    try:
        runners[1] = start_runner(1)
        runners[2] = start_runner(2)
        blocks = {SEQUENTIAL: generate_then_work(runners[1]),
                  AHEAD_1: submit_ahead(runners[1]), AHEAD_2: submit_ahead(runners[2])}
        size = max(1, -(-s.pipeline_steps // s.pipeline_rounds))
        for c_ms, w_ms in s.pipeline_steps_ms:
            c, w = c_ms / 1e3, w_ms / 1e3
            for run in blocks.values():
                run(c, w, s.pipeline_warmup, [])
            gc.collect()
            steps: dict[str, list[Step]] = {k: [] for k in blocks}
            for r in range(s.pipeline_rounds):
                for key in list(blocks) if r % 2 == 0 else list(blocks)[::-1]:
                    blocks[key](c, w, size, steps[key])
            for key, got in steps.items():
                took, bound = zip(*got, strict=True)
                results.put(METRIC, config(c_ms, w_ms), key, summarize(took))
                results.put(METRIC, config(c_ms, w_ms), f"{key} {FLOOR}", summarize(bound))
    finally:
        for runner in runners.values():
            runner.shutdown()


def config(c_ms: int, w_ms: int) -> str:
    return f"C={c_ms} ms, W={w_ms} ms"


def rows(results: Results, settings: Settings) -> list[Row]:
    section = (f"Pipelined steps (a rank computes C ms per step, the app works W ms on each "
               f"result; world_size {WORLD_SIZE})")
    out = []
    for c_ms, w_ms in settings.pipeline_steps_ms:
        cfg = config(c_ms, w_ms)
        for key in (SEQUENTIAL, AHEAD_1, AHEAD_2):
            row = Row(section=section, case=f"{cfg}: {key}", unit="ms",
                      ours=results.get(METRIC, cfg, key),
                      floor=results.get(METRIC, cfg, f"{key} {FLOOR}"),
                      floor_label="max(C, W) per step, both as measured: the bound "
                                  "1 / max(C, W) steps/s")
            if row.ours is not None and row.floor is not None:
                rate, share = 1 / row.ours.median, row.floor.median / row.ours.median
                if key == AHEAD_2:
                    row.target = f"≥ {GOAL:g} of bound ({rate:.1f} steps/s, {share:.2f})"
                    row.met = share >= GOAL
                else:
                    row.target = f"(info: {rate:.1f} steps/s, {share:.2f} of bound)"
            out.append(row)
    return out
