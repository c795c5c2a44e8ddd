"""Failure notice: how long a caller waits to learn that a rank died
(SIGKILL mid-call -> ``WorkerCrashed``) or hangs (-> ``WorkerTimeout``), and how long
``shutdown()`` then takes to clear the hung ranks. Every trial needs a fresh runner:
after a failure the runner is unusable by contract."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
import time

from benchmarks.config import Settings
from benchmarks.implementations.pools import OURS
from benchmarks.report.results import FLOOR, Results, Row
from benchmarks.report.stats import summarize

WORLD_SIZE = 2
CRASH_TARGET_S = 0.100
IN_CALL_DELAY_S = 0.1  # let the call reach the ranks before the kill
SLEEP_S = 60.0  # longer than any trial: the ranks are inside generate() when it ends


def _runner(pid_dir: str, call_timeout: float):  # -> DistributedRunner
    from benchmarks.implementations.bench_workers import BenchWorker
    from reactor_dist import DistributedRunner

    return DistributedRunner(BenchWorker, world_size=WORLD_SIZE, init_process_group=False,
                             load_kwargs={"pid_dir": pid_dir}, call_timeout=call_timeout,
                             start_timeout=120.0)


def _read_pid(pid_dir: str, rank: int) -> int:
    with open(os.path.join(pid_dir, f"rank{rank}.pid")) as f:
        return int(f.read())


def crash_trial(rank: int) -> tuple[float, float]:
    """(SIGKILL of ``rank`` -> WorkerCrashed raised, shutdown() after it) in seconds."""
    from reactor_dist import WorkerCrashed

    pid_dir = tempfile.mkdtemp(prefix=f"rdbench-{os.getpid()}-pids-")
    runner = _runner(pid_dir, call_timeout=SLEEP_S * 2)
    try:
        runner.start()
        pid = _read_pid(pid_dir, rank)
        killed_at: list[float] = []

        def kill() -> None:
            time.sleep(IN_CALL_DELAY_S)
            killed_at.append(time.perf_counter())
            os.kill(pid, signal.SIGKILL)

        killer = threading.Thread(target=kill, daemon=True)
        killer.start()
        try:
            runner.generate(("sleep", SLEEP_S))
        except WorkerCrashed:
            noticed = time.perf_counter()
        else:
            raise RuntimeError("the call returned although a rank was killed")
        finally:
            killer.join()
        if not killed_at or noticed < killed_at[0]:
            raise RuntimeError("WorkerCrashed came before the kill")
        t0 = time.perf_counter()
        runner.shutdown()
        return noticed - killed_at[0], time.perf_counter() - t0
    finally:
        runner.shutdown()
        shutil.rmtree(pid_dir, ignore_errors=True)


def timeout_trial(call_timeout: float) -> tuple[float, float]:
    """(call -> WorkerTimeout while every rank hangs, shutdown() of the hung ranks)."""
    from reactor_dist import WorkerTimeout

    pid_dir = tempfile.mkdtemp(prefix=f"rdbench-{os.getpid()}-pids-")
    runner = _runner(pid_dir, call_timeout=call_timeout)
    try:
        runner.start()
        t0 = time.perf_counter()
        try:
            runner.generate(("sleep", SLEEP_S))
        except WorkerTimeout:
            noticed = time.perf_counter() - t0
        else:
            raise RuntimeError("a hung call returned")
        t1 = time.perf_counter()
        runner.shutdown()
        return noticed, time.perf_counter() - t1
    finally:
        runner.shutdown()
        shutil.rmtree(pid_dir, ignore_errors=True)


def measure(settings: Settings, results: Results) -> None:
    s = settings
    for rank in range(WORLD_SIZE):
        trials = [crash_trial(rank) for _ in range(max(1, s.crash_trials // WORLD_SIZE))]
        results.put("crash", f"rank{rank}", OURS, summarize([t[0] for t in trials]))
        results.put("crash-shutdown", f"rank{rank}", OURS, summarize([t[1] for t in trials]))
    trials = [timeout_trial(s.call_timeout_s) for _ in range(s.timeout_trials)]
    results.put("timeout", "all", OURS, summarize([t[0] for t in trials]))
    results.put("timeout", "all", FLOOR, summarize([s.call_timeout_s]))
    results.put("timeout-shutdown", "all", OURS, summarize([t[1] for t in trials]))


def rows(results: Results, settings: Settings) -> list[Row]:
    s = settings
    section = f"Failure notice (world_size {WORLD_SIZE})"
    out = []
    for rank in range(WORLD_SIZE):
        crash = results.get("crash", f"rank{rank}", OURS)
        out.append(Row(section=section, case=f"SIGKILL rank {rank} mid-call -> WorkerCrashed",
                       unit="ms", ours=crash, target="≤ 100 ms",
                       met=None if crash is None else crash.median <= CRASH_TARGET_S))
    hang = f"hang -> WorkerTimeout (call_timeout {s.call_timeout_s:g} s)"
    timeout = results.get("timeout", "all", OURS)
    late = "" if timeout is None else \
        f"(info: +{(timeout.median - s.call_timeout_s) * 1e3:.0f} ms after the timeout)"
    out.append(Row(section=section, case=hang, unit="ms", ours=timeout,
                   floor=results.get("timeout", "all", FLOOR), floor_label="call_timeout",
                   target=late))
    out.append(Row(section=section, case="shutdown() after the crash", unit="ms",
                   ours=results.get("crash-shutdown", "rank1", OURS)))
    out.append(Row(section=section, case="shutdown() of hung ranks after the timeout",
                   unit="ms", ours=results.get("timeout-shutdown", "all", OURS)))
    return out
