"""One call against the bare bus at every world size (1, 2, 4, 8): time, the caller's
CPU and the ranks' CPU per call; small calls in flight; one stream item.

Ours is ``pools.EchoRunner`` (``generate(1)`` on a worker that returns its input); the
bus is bare pyzmq peers, PUB -> SUB and PUSH -> PULL, one per rank
(``raw_floor.RawFloor``); between them the protocol's own floor, our wire in
straight-line Python with no bookkeeping (``protocol_floor.ProtocolFloor``: the MAC, the
fixed header, pickle), which says how much of the gap is the protocol's and how much the
runner's; and the same without the MAC (its bytes zeroed, unchecked), which says what
the MAC costs.  For each world size a fresh runner and fresh peers of both kinds are timed
in alternating blocks (``calls_per_block`` calls each, the order flipping every round);
each block reads, besides the wall time of every call, the CPU time of the caller's
process (every thread: its own, ZeroMQ's I/O thread, the runner's) and of every rank's
process (or peer's), from /proc through psutil.  The baselines (a JSON line over a pipe
per rank, multiprocessing queues) are timed per call at each world size in a rotation
of their own.  Below the table: ``max_in_flight=8`` submits against the bus with 8
messages ahead, in calls per second, and a stream of small items against rank 0
sending as many messages.  A world size above the machine's cores shares them (the
runner warns), and so do the peers: both pay alike.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable

import psutil

from benchmarks.config import Settings
from benchmarks.families.overhead import baselines_per_call
from benchmarks.implementations.pools import IMPLEMENTATIONS, OURS, EchoRunner
from benchmarks.implementations.protocol_floor import ProtocolFloor
from benchmarks.implementations.raw_floor import RawFloor
from benchmarks.report.results import FLOOR, Results, Row
from benchmarks.report.stats import Stats, summarize
from reactor_dist.placement.template import Template

CALL, CALLER, RANKS = "ws call", "ws caller cpu", "ws ranks cpu"
IN_FLIGHT, ITEM = "ws in flight", "ws stream item"
AHEAD = 8  # max_in_flight of the in-flight rows, and the bus's messages ahead
ITEMS = 32  # items of the stream row's step
INPUT = 1
PROTOCOL, UNSIGNED = "protocol", "unsigned"  # the protocol floor's results keys
TARGET_CALL, TARGET_CALLER, TARGET_RANK = 1.3, 1.5, 1.3  # issue 52's goals, x the bus
TARGET_IN_FLIGHT, TARGET_ITEM = 0.8, 1.3


def children() -> set[int]:
    """This process's children but the rank templates the ranks are forked from."""
    return {p.pid for p in psutil.Process().children()} - Template.pids()


def started_since(before: set[int], count: int) -> list[psutil.Process]:
    new = [psutil.Process(p) for p in children() - before]
    if len(new) != count:
        raise RuntimeError(f"expected {count} new child processes, found {len(new)}")
    return new


def cpu_seconds(processes: list[psutil.Process]) -> float:
    """User + system CPU of ``processes``, every thread (children not counted)."""
    total = 0.0
    for p in processes:
        t = p.cpu_times()
        total += t.user + t.system
    return total


class Side:
    """One system timed in blocks: each call's wall time, and over all its blocks the CPU
    of the caller's process and of the rank processes (/proc counts in clock ticks, 10 ms:
    a block alone is too short to read)."""

    def __init__(self, call: Callable[[], object], ranks: list[psutil.Process]) -> None:
        self.call, self.ranks = call, ranks
        self.walls: list[float] = []
        self.calls = 0
        self.caller = self.rank_cpu = 0.0

    def block(self, calls: int) -> None:
        call, walls, clock = self.call, self.walls, time.perf_counter
        caller0, ranks0 = time.process_time(), cpu_seconds(self.ranks)
        for _ in range(calls):
            t0 = clock()
            call()
            walls.append(clock() - t0)
        self.caller += time.process_time() - caller0
        self.rank_cpu += cpu_seconds(self.ranks) - ranks0
        self.calls += calls


def one_world_size(ws: int, s: Settings, results: Results) -> None:
    cfg = f"ws{ws}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # more ranks than cores: said in the docstring
        before = children()
        ours = EchoRunner(ws)
    try:
        our_ranks = started_since(before, ws)
        before = children()
        bus = RawFloor(ws)
        bus_peers = started_since(before, ws)
        before = children()
        protocol = ProtocolFloor(ws)
        protocol_peers = started_since(before, ws)
        before = children()
        unsigned = ProtocolFloor(ws, mac=False)
        try:
            sides = {OURS: Side(lambda: ours.generate(INPUT), our_ranks),
                     FLOOR: Side(bus.generate, bus_peers),
                     PROTOCOL: Side(lambda: protocol.generate(INPUT), protocol_peers),
                     UNSIGNED: Side(lambda: unsigned.generate(INPUT),
                                    started_since(before, ws))}
            for side in sides.values():
                for _ in range(s.call_warmup):
                    side.call()
            for i in range(s.call_rounds):
                for key in (list(sides) if i % 2 == 0 else list(sides)[::-1]):
                    sides[key].block(max(1, s.call_iters // s.call_rounds))
            for key, side in sides.items():
                results.put(CALL, cfg, key, summarize(side.walls))
                results.put(CALLER, cfg, key, summarize([side.caller / side.calls]))
                results.put(RANKS, cfg, key, summarize([side.rank_cpu / side.calls]))
        finally:
            unsigned.close()
            protocol.close()
            bus.close()
    finally:
        ours.close()
    baselines_per_call(CALL, ws, s, results)


def in_flight_and_items(ws: int, s: Settings, results: Results) -> None:
    """Calls per second with AHEAD in flight, and the seconds per stream item, ours
    against the bus, in alternating blocks."""
    from benchmarks.implementations.bench_workers import EchoWorker, ItemsWorker
    from reactor_dist import DistributedRunner

    cfg = f"ws{ws}"
    calls = max(AHEAD * 4, s.call_iters // s.call_rounds)
    ahead = DistributedRunner(EchoWorker, world_size=ws, init_process_group=False,
                              device="cpu", max_in_flight=AHEAD, call_timeout=120.0)
    streams = DistributedRunner(ItemsWorker, world_size=ws, init_process_group=False,
                                device="cpu", call_timeout=120.0)
    bus = RawFloor(ws)
    protocol = ProtocolFloor(ws)
    unsigned = ProtocolFloor(ws, mac=False)
    try:
        ahead.start()
        streams.start()

        def submitted() -> None:
            futures = [ahead.submit(INPUT) for _ in range(min(AHEAD, calls))]
            for sent in range(len(futures), calls + len(futures)):
                futures.pop(0).result()
                if sent < calls:
                    futures.append(ahead.submit(INPUT))

        def streamed() -> None:
            assert sum(1 for _ in streams.stream(ITEMS)) == ITEMS

        blocks: dict[str, tuple[Callable[[], object], float]] = {
            f"{OURS} {IN_FLIGHT}": (submitted, calls),
            f"{FLOOR} {IN_FLIGHT}": (lambda: bus.pipelined(calls, AHEAD), calls),
            f"{OURS} {ITEM}": (streamed, ITEMS),
            f"{FLOOR} {ITEM}": (lambda: bus.stream(ITEMS), ITEMS),
            f"{PROTOCOL} {IN_FLIGHT}": (lambda: protocol.pipelined(calls, AHEAD), calls),
            f"{PROTOCOL} {ITEM}": (lambda: protocol.stream(ITEMS), ITEMS),
            f"{UNSIGNED} {IN_FLIGHT}": (lambda: unsigned.pipelined(calls, AHEAD), calls),
        }
        samples: dict[str, list[float]] = {k: [] for k in blocks}
        for block, _ in blocks.values():
            block()  # warm
        for i in range(s.call_rounds):
            for key in (list(blocks) if i % 2 == 0 else list(blocks)[::-1]):
                block, per = blocks[key]
                t0 = time.perf_counter()
                block()
                samples[key].append((time.perf_counter() - t0) / per)
        for key, values in samples.items():
            impl, metric = key.split(" ", 1)
            results.put(metric, cfg, impl, summarize(values))
    finally:
        unsigned.close()
        protocol.close()
        bus.close()
        streams.shutdown()
        ahead.shutdown()


def measure(settings: Settings, results: Results) -> None:
    for ws in settings.table_world_sizes:
        one_world_size(ws, settings, results)
    in_flight_and_items(2, settings, results)


def _ratio_row(section: str, case: str, ours: Stats | None, bus: Stats | None, target: float,
               *, at_least: bool = False, baselines: dict[str, Stats | None] | None = None,
               label: str = "the bare bus, measured in the same run") -> Row:
    row = Row(section=section, case=case, unit="us", ours=ours, floor=bus, floor_label=label,
              baselines=baselines or {})
    ratio = row.over_floor
    if at_least:  # a rate: seconds per call, so the bus's over ours
        row.target = f"≥ {target:g}× the bus's rate"
        row.met = None if ratio is None else 1 / ratio >= target
    else:
        row.target = f"≤ {target:g}× the bus"
        row.met = None if ratio is None else ratio <= target
    return row


def _floor_row(section: str, case: str, protocol: Stats | None, bus: Stats | None,
               label: str = "the bare bus, measured in the same run") -> Row:
    """What our wire costs in straight Python with no bookkeeping, against the bus: the
    share of the gap that is the protocol's (no target: a floor, not a goal)."""
    return Row(section=section, case=case, unit="us", ours=protocol, floor=bus,
               floor_label=label, target="(info: the protocol's floor)")


def rows(results: Results, settings: Settings) -> list[Row]:
    section = "World sizes against the bare bus"
    out = []
    first: dict[str, Stats | None] = {}
    for ws in settings.table_world_sizes:
        cfg = f"ws{ws}"
        out.append(_ratio_row(
            section, f"generate(1), world_size {ws}", results.get(CALL, cfg, OURS),
            results.get(CALL, cfg, FLOOR), TARGET_CALL,
            baselines={i: results.get(CALL, cfg, i) for i in IMPLEMENTATIONS if i != OURS}))
        out.append(_ratio_row(section, f"the caller's CPU per call, world_size {ws}",
                              results.get(CALLER, cfg, OURS), results.get(CALLER, cfg, FLOOR),
                              TARGET_CALLER))
        ranks = _ratio_row(section, f"the ranks' CPU per call, world_size {ws}",
                           results.get(RANKS, cfg, OURS), results.get(RANKS, cfg, FLOOR),
                           TARGET_RANK)
        ranks.target, ranks.met = "(info)", None
        out.append(ranks)
        out.append(_floor_row(section, f"the protocol alone, world_size {ws}",
                              results.get(CALL, cfg, PROTOCOL), results.get(CALL, cfg, FLOOR)))
        out.append(_floor_row(section, f"the protocol alone without the MAC, world_size {ws}",
                              results.get(CALL, cfg, UNSIGNED), results.get(CALL, cfg, FLOOR)))
        if not first:
            first = {k: results.get(CALLER, cfg, k) for k in (OURS, FLOOR)}
    last = f"ws{settings.table_world_sizes[-1]}"
    lo, hi = settings.table_world_sizes[0], settings.table_world_sizes[-1]
    ours_hi, bus_hi = results.get(CALLER, last, OURS), results.get(CALLER, last, FLOOR)
    if hi > lo and None not in (ours_hi, bus_hi, first.get(OURS), first.get(FLOOR)):
        per_rank = (ours_hi.median - first[OURS].median) / (hi - lo)
        bus_per_rank = (bus_hi.median - first[FLOOR].median) / (hi - lo)
        row = Row(section=section, case=f"the caller's CPU for each rank beyond the first "
                  f"(world_size {lo} to {hi})", unit="us", ours=summarize([per_rank]),
                  floor=summarize([bus_per_rank]), floor_label="the bus's, the same way",
                  target=f"≤ {TARGET_RANK:g}× the bus's")
        row.met = bus_per_rank > 0 and per_rank / bus_per_rank <= TARGET_RANK
        out.append(row)
    out.append(_ratio_row(section, f"submit() with max_in_flight={AHEAD}, world_size 2, "
                          "per call", results.get(IN_FLIGHT, "ws2", OURS),
                          results.get(IN_FLIGHT, "ws2", FLOOR), TARGET_IN_FLIGHT, at_least=True,
                          label=f"the bus with {AHEAD} messages ahead"))
    out.append(_ratio_row(section, "one stream item, world_size 2",
                          results.get(ITEM, "ws2", OURS), results.get(ITEM, "ws2", FLOOR),
                          TARGET_ITEM, label="one message of rank 0's"))
    out.append(_floor_row(section, f"the protocol alone, max_in_flight={AHEAD}, world_size 2, "
                          "per call", results.get(IN_FLIGHT, "ws2", PROTOCOL),
                          results.get(IN_FLIGHT, "ws2", FLOOR),
                          label=f"the bus with {AHEAD} messages ahead"))
    out.append(_floor_row(section, f"the protocol alone without the MAC, max_in_flight={AHEAD}, "
                          "world_size 2, per call", results.get(IN_FLIGHT, "ws2", UNSIGNED),
                          results.get(IN_FLIGHT, "ws2", FLOOR),
                          label=f"the bus with {AHEAD} messages ahead"))
    out.append(_floor_row(section, "the protocol alone, one stream item, world_size 2",
                          results.get(ITEM, "ws2", PROTOCOL), results.get(ITEM, "ws2", FLOOR),
                          label="one message of rank 0's"))
    return out

