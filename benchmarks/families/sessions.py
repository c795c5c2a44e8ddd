"""Sessions (``snapshot_every=K``): what snapshots cost a step, and a fault the caller never
sees.

- **Snapshot cost**: world_size 1 and 2, each rank's session state ``STATE_MB`` MB, a
  trivial ``generate``; the per-step time with ``snapshot_every=K`` (K = 1 and 8)
  against the same runner options without snapshots, in alternating blocks.  A
  snapshot's cost is the difference times K, set against its floor, measured here in
  the same run: a memcpy of every rank's state, side by side (one thread per rank, each
  copying ``STATE_MB`` MB: a snapshot is one copy of each rank's state into shared
  memory, on every rank at once, and on two cores two copies share the memory's
  bandwidth).  Goal: a snapshot ≤ ``COPY_GOAL`` × that floor.
- **Transparent recovery**: world_size 4 with one spare, K = 8, ``load()`` 2 s of CPU
  per rank; ``REPLAYED`` calls after the last snapshot, then a call that sleeps
  ``CALL_S`` before its ``all_reduce``, rank 2 SIGKILLed while it sleeps.  From the kill
  to the call's result (``max_restarts=1, retry_failed=True``): the spare takes the
  place, every rank restores the snapshot, the kept calls run again, the call is sent
  again, and the caller gets its result.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np

from benchmarks.config import Settings
from benchmarks.implementations.pools import OURS
from benchmarks.report.results import Results, Row
from benchmarks.report.stats import summarize
from reactor_dist import DistributedWorker

STATE_MB = 64
KS = (1, 8)
SNAPSHOT_WORLD_SIZES = (1, 2)
COPY_GOAL = 1.5
STEPS = 32  # timed steps per block (a multiple of every K)
BLOCKS = 4  # alternating blocks of STEPS, per trial, with and without snapshots
WORLD_SIZE = 4  # transparent recovery
LOAD_CPU_S = 2.0
VICTIM = 2
REPLAYED = 4  # kept calls after the last snapshot, re-run by the restart
CALL_S = 0.5  # the killed call's sleep before its all_reduce


class SessionState(DistributedWorker):
    """A session state of ``mb`` MB per rank; ``generate(x)`` touches it and returns x.
    With ``cpu_seconds``, load() burns that much CPU and generate all_reduces x (a tuple
    ``(seconds, x)`` sleeps first: a call in which a rank can be killed mid-way)."""

    def load(self, mb: int = STATE_MB, cpu_seconds: float = 0.0) -> None:
        end = time.process_time() + cpu_seconds
        while time.process_time() < end:
            pass
        self.state = np.ones(max(mb << 20, 1), np.uint8)
        self.grouped = cpu_seconds > 0

    def generate(self, x, /):
        if isinstance(x, tuple):
            seconds, x = x
            time.sleep(seconds)
        self.state[0] = int(x) % 256
        if self.grouped:
            import torch
            import torch.distributed as dist

            t = torch.tensor([float(x)])
            dist.all_reduce(t)
            return float(t)
        return x

    def reset(self) -> None:
        pass

    def snapshot(self):
        return self.state

    def restore(self, state) -> None:
        self.state = state

    def rejoin(self) -> None:
        pass


def memcpy_seconds(side_by_side: int, trials: int = 9) -> list[float]:
    """A memcpy of STATE_MB MB in each of ``side_by_side`` threads at once (numpy copies
    without the GIL), into warm pages as a pool's are."""
    import threading

    sources = [np.ones(STATE_MB << 20, np.uint8) for _ in range(side_by_side)]
    targets = [np.empty_like(source) for source in sources]
    for source, target in zip(sources, targets, strict=True):
        np.copyto(target, source)
    seconds = []
    for _ in range(trials):
        threads = [threading.Thread(target=np.copyto, args=(target, source))
                   for source, target in zip(sources, targets, strict=True)]
        began = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        seconds.append(time.perf_counter() - began)
    return seconds


def per_step(world_size: int, every: int, blocks: int) -> tuple[list[float], list[float]]:
    """Seconds per step without snapshots and with ``snapshot_every=every``, in
    alternating blocks of STEPS (each block ends once the ranks are idle: the last
    snapshot counts)."""
    from reactor_dist import DistributedRunner

    runners = {k: DistributedRunner(SessionState, world_size=world_size, device="cpu",
                                    init_process_group=False, snapshot_every=k,
                                    call_timeout=60.0) for k in (0, every)}
    times: dict[int, list[float]] = {0: [], every: []}
    try:
        for runner in runners.values():
            runner.start()
            for x in range(STEPS):  # warm: every pool at its steady size
                runner.generate(x)
            runner.wait_idle()
        for block in range(blocks):
            for k in ((0, every) if block % 2 == 0 else (every, 0)):
                runner = runners[k]
                began = time.perf_counter()
                for x in range(STEPS):
                    runner.generate(x)
                runner.wait_idle()
                times[k].append((time.perf_counter() - began) / STEPS)
    finally:
        for runner in runners.values():
            runner.shutdown()
    return times[0], times[every]


def transparent_recovery() -> float:
    """One fault the caller never sees; seconds from the kill to the call's result."""
    from reactor_dist import DistributedRunner

    runner = DistributedRunner(SessionState, world_size=WORLD_SIZE, device="cpu",
                               load_kwargs={"mb": 1, "cpu_seconds": LOAD_CPU_S},
                               snapshot_every=8, spares=1, max_restarts=1, retry_failed=True,
                               start_timeout=300.0, call_timeout=60.0, shutdown_grace=2.0)
    with runner:
        for x in range(8 + REPLAYED):  # a snapshot after the 8th: REPLAYED calls kept
            if runner.generate(x) != x * WORLD_SIZE:
                raise RuntimeError("a wrong sum before the fault")
        runner.wait_idle()
        victim = runner.ranks[VICTIM].pid
        future = runner.submit((CALL_S, 100))
        time.sleep(CALL_S / 2)
        killed = time.perf_counter()
        os.kill(victim, signal.SIGKILL)
        if future.result() != 100 * WORLD_SIZE:
            raise RuntimeError("the retried call gave a wrong sum")
        seconds = time.perf_counter() - killed
        stats = runner.stats()
        if (stats.retried, stats.replayed, runner.spare_takeovers) != (1, REPLAYED, 1):
            raise RuntimeError(f"not the recovery measured: retried {stats.retried}, "
                               f"replayed {stats.replayed}, taken {runner.spare_takeovers}")
    return seconds


def measure(settings: Settings, results: Results) -> None:
    blocks = 2 if settings.quick else BLOCKS
    for world_size in SNAPSHOT_WORLD_SIZES:
        results.put("sessions", f"memcpy x{world_size}", OURS,
                    summarize(memcpy_seconds(world_size)))
        for every in KS:
            case = f"ws={world_size} K={every}"
            try:
                without, with_ = per_step(world_size, every, blocks)
            except Exception as exc:  # noted; the other rows still run
                results.notes.append(f"{OURS}: snapshots {case} failed: {exc!r}")
                continue
            results.put("sessions", f"without {case}", OURS, summarize(without))
            results.put("sessions", case, OURS, summarize(with_))
            # Each block's snapshot cost against the block beside it.
            cost = [(w - o) * every for w, o in zip(with_, without, strict=True)]
            results.put("sessions", f"snapshot {case}", OURS, summarize(cost))
    trials = 1 if settings.quick else settings.recovery_trials
    seconds = []
    for _ in range(trials):
        try:
            seconds.append(transparent_recovery())
        except Exception as exc:
            results.notes.append(f"{OURS}: transparent recovery failed: {exc!r}")
    if seconds:
        results.put("sessions", "transparent recovery", OURS, summarize(seconds))


def rows(results: Results, settings: Settings) -> list[Row]:
    section = (f"Sessions ({STATE_MB} MB of session state per rank, a trivial generate(); "
               f"a snapshot = (step with snapshot_every=K - step without) x K; floor: a "
               f"memcpy of every rank's state, side by side)")
    out = []
    for world_size in SNAPSHOT_WORLD_SIZES:
        memcpy = results.get("sessions", f"memcpy x{world_size}", OURS)
        for every in KS:
            case = f"ws={world_size} K={every}"
            st = results.get("sessions", f"snapshot {case}", OURS)
            target, met = f"≤ {COPY_GOAL:g} × floor", None
            if st is not None and memcpy is not None:
                target += f" (info: {st.median / memcpy.median:.2f} ×)"
                met = st.median <= COPY_GOAL * memcpy.median
            out.append(Row(section=section,
                           case=f"world_size {world_size}: a snapshot, snapshot_every={every}",
                           unit="ms", ours=st, floor=memcpy,
                           floor_label=f"memcpy {STATE_MB} MB x {world_size}", target=target,
                           met=met))
            step = results.get("sessions", case, OURS)
            bare = results.get("sessions", f"without {case}", OURS)
            out.append(Row(section=section,
                           case=f"world_size {world_size}: a step, snapshot_every={every}",
                           unit="ms", ours=step, floor=bare,
                           floor_label="a step without snapshots", target="info"))
    st = results.get("sessions", "transparent recovery", OURS)
    out.append(Row(
        section=(f"Transparent recovery (world_size {WORLD_SIZE}, 1 spare, snapshot_every=8, "
                 f"load() = {LOAD_CPU_S:g} s of CPU per rank, {REPLAYED} calls since the "
                 f"snapshot, rank {VICTIM} SIGKILLed mid-call; retry_failed=True)"),
        case=f"kill -> the call's result (no error; its own {CALL_S:g} s run again included)",
        unit="s", ours=st,
        target="info"))
    return out
