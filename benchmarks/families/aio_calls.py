"""asyncio per-call cost: ``await runner.agenerate(1)`` and one ``async for`` over
``runner.astream(1)`` against ``runner.generate(1)``, on one echo runner (a worker that
returns its input, world_size 2), in the same run.

The three are timed in alternating blocks (the order flipping every round) so that drift
in the machine's load hits them alike. The async calls run in one event loop (a block is
one ``run_until_complete``); each call is timed inside its task, one
``time.perf_counter()`` pair around the ``await`` or the ``async for``, as an
application's task would see it. Targets: ``agenerate`` ≤ generate(1) + 15 µs (issue
52's goal), one ``astream`` step ≤ generate(1) + 50 µs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from benchmarks.config import Settings
from benchmarks.families.overhead import INPUT
from benchmarks.implementations.pools import EchoRunner
from benchmarks.report.results import Results, Row
from benchmarks.report.stats import alternate_blocks, record_calls, summarize

WORLD_SIZE = 2
METRIC = "aio call"
GENERATE, AGENERATE, ASTREAM = "generate(1)", "agenerate(1)", "astream(1)"
# Above generate(1): agenerate's (issue 52's goal) and one astream step's.
TARGETS_S = {AGENERATE: 15e-6, ASTREAM: 50e-6}


async def _agenerate_block(runner, n: int, into: list[float]) -> None:
    for _ in range(n):
        t0 = time.perf_counter()
        out = await runner.agenerate(INPUT)
        t1 = time.perf_counter()
        if out != INPUT:
            raise RuntimeError(f"agenerate echoed {out!r}")
        into.append(t1 - t0)


async def _astream_block(runner, n: int, into: list[float]) -> None:
    for _ in range(n):
        t0 = time.perf_counter()
        got = [item async for item in runner.astream(INPUT)]
        t1 = time.perf_counter()
        if got != [INPUT]:
            raise RuntimeError(f"astream gave {got!r}")
        into.append(t1 - t0)


def measure(settings: Settings, results: Results) -> None:
    s = settings
    echo = EchoRunner(WORLD_SIZE)
    loop = asyncio.new_event_loop()
    try:
        runner = echo.runner
        if runner.generate(INPUT) != INPUT:
            raise RuntimeError("the echo worker did not echo")
        blocks: dict[str, Callable[[int, list[float]], None]] = {
            GENERATE: lambda n, into: record_calls(lambda: runner.generate(INPUT), n, into),
            AGENERATE: lambda n, into: loop.run_until_complete(
                _agenerate_block(runner, n, into)),
            ASTREAM: lambda n, into: loop.run_until_complete(_astream_block(runner, n, into)),
        }
        samples = alternate_blocks(blocks, calls=s.aio_calls, warmup=s.aio_warmup,
                                   rounds=s.aio_rounds)
    finally:
        loop.close()
        echo.close()
    for key, v in samples.items():
        results.put(METRIC, f"ws{WORLD_SIZE}", key, summarize(v))


def rows(results: Results, settings: Settings) -> list[Row]:
    cfg = f"ws{WORLD_SIZE}"
    base = results.get(METRIC, cfg, GENERATE)
    out = []
    for key, case in ((AGENERATE, "await runner.agenerate(1)"),
                      (ASTREAM, "async for over runner.astream(1), one item")):
        limit = TARGETS_S[key]
        row = Row(section=f"asyncio per call (echo worker, world_size {WORLD_SIZE})",
                  case=case, unit="us", ours=results.get(METRIC, cfg, key), floor=base,
                  floor_label="runner.generate(1) on the same runner, alternating blocks",
                  target=f"≤ generate + {limit * 1e6:.0f} µs")
        if row.ours is not None and base is not None:
            extra = row.ours.median - base.median
            row.target = f"≤ generate + {limit * 1e6:.0f} µs ({extra * 1e6:+.0f} µs)"
            row.met = extra <= limit
        out.append(row)
    return out
