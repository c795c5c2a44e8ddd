"""What is measured. Every family is a module with the same two functions:

- ``measure(settings, results)``: run it, putting its trials into ``results`` (a family
  that fails part-way notes it in ``results.notes``; the others still run);
- ``rows(results, settings)``: its rows of the table, from those trials.

``FAMILIES`` is the order ``python -m benchmarks.run`` runs them in and prints them.
"""

from __future__ import annotations

from types import ModuleType

from benchmarks.families import (
    aio_calls,
    broadcast,
    collective_ring,
    cpu_copy,
    failure,
    frames,
    frames_gpu,
    joined,
    metrics_cost,
    overhead,
    pipelined,
    placement,
    recovery,
    sessions,
    startup,
    streaming,
    timings,
    world_size,
)

FAMILIES: tuple[tuple[str, ModuleType], ...] = (
    ("per-call overhead", overhead),
    ("world sizes against the bus", world_size),
    ("asyncio per call", aio_calls),
    ("per-call timings", timings),
    ("metrics cost", metrics_cost),
    ("collective rings", collective_ring),
    ("frames back", frames),
    ("frames from a GPU", frames_gpu),
    ("a fresh CPU buffer per call", cpu_copy),
    ("streaming", streaming),
    ("pipelined steps", pipelined),
    ("input broadcast", broadcast),
    ("failure notice", failure),
    ("start-up", startup),
    ("Ray placement", placement),
    ("recovery", recovery),
    ("joined ranks' faults", joined),
    ("sessions", sessions),
)
