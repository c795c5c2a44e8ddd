"""Joined ranks' faults (placement="external"): how long a runner takes to notice that a
rank another launcher started is gone, and how long the ranks take to end once the
application is gone.  World size 2, both ranks joined by hand on 127.0.0.1
(``python -m reactor_dist.rank --join ... --rank N``); every trial a fresh runner.

- rank SIGKILLed: its joiner sees it die and tells the runner;
- joiner SIGKILLed: its connection closed, found at the next beat;
- joiner SIGSTOPped: a hang, its silence (``JOIN_SILENCE``);
- application SIGKILLed: each joiner ends its rank and exits (its connection closed).

Goals: each of the first three <= 1 s from the signal to ``runner.healthy`` turning
false; the last <= 2 s from the SIGKILL to every joiner and rank gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil

from benchmarks.config import Settings
from benchmarks.implementations.pools import OURS
from benchmarks.report.results import Results, Row
from benchmarks.report.stats import summarize
from reactor_dist import DistributedWorker

WORLD_SIZE = 2
NOTICE_GOAL_S = 1.0
GONE_GOAL_S = 2.0
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = "benchmarks.families.joined:JoinedSum"
CASES = ("rank SIGKILLed", "joiner SIGKILLed", "joiner SIGSTOPped")
GONE = "application SIGKILLed"


class JoinedSum(DistributedWorker):
    """generate(x): x summed over the ranks (an all_reduce); ``"pid"``: the rank's pid."""

    def generate(self, x, /):
        import torch
        import torch.distributed as dist

        if x == "pid":
            return [os.getpid()]
        t = torch.tensor([float(x)])
        dist.all_reduce(t)
        return float(t)

    def reset(self) -> None:
        pass


def join(command: str, rank: int) -> subprocess.Popen:
    """A joiner of rank ``rank``, as a launcher starts it (a session of its own)."""
    return subprocess.Popen(
        [sys.executable, "-m", "reactor_dist.rank", *command.split()[1:], "--rank", str(rank),
         "--world-size", str(WORLD_SIZE)], cwd=REPO, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": REPO})


def notice_trial(case: str) -> float:
    """Seconds from the signal to the runner knowing rank 1 is gone."""
    import threading

    from reactor_dist import DistributedRunner

    runner = DistributedRunner(JoinedSum, world_size=WORLD_SIZE, device="cpu",
                               placement="external", start_timeout=120.0)
    joiners: list[subprocess.Popen] = []
    starting = threading.Thread(target=runner.start)
    try:
        starting.start()
        while not runner.join_command:
            time.sleep(0.01)
        joiners = [join(runner.join_command, rank) for rank in range(WORLD_SIZE)]
        starting.join()
        assert runner.generate(1.0) == WORLD_SIZE
        rank_pid = psutil.Process(joiners[1].pid).children()[0].pid
        target, sig = {CASES[0]: (rank_pid, signal.SIGKILL),
                       CASES[1]: (joiners[1].pid, signal.SIGKILL),
                       CASES[2]: (joiners[1].pid, signal.SIGSTOP)}[case]
        began = time.perf_counter()
        os.kill(target, sig)
        while runner.healthy and time.perf_counter() - began < 30:
            time.sleep(0.001)
        return time.perf_counter() - began
    finally:
        runner.shutdown()
        for proc in joiners:
            with_children = [proc.pid] + [c.pid for c in _children(proc.pid)]
            for pid in with_children:
                for sig in (signal.SIGCONT, signal.SIGKILL):
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
            proc.wait(10)


def _running(proc: psutil.Process) -> bool:
    """Not gone: a zombie has ended (it waits only for init, its new parent, to reap it)."""
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _children(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


APP = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {repo!r})
    from benchmarks.families.joined import JoinedSum, WORLD_SIZE, join
    from reactor_dist import DistributedRunner
    runner = DistributedRunner(JoinedSum, world_size=WORLD_SIZE, device="cpu",
                               placement="external", start_timeout=120.0)
    import threading
    starting = threading.Thread(target=runner.start)
    starting.start()
    while not runner.join_command:
        time.sleep(0.01)
    joiners = [join(runner.join_command, rank) for rank in range(WORLD_SIZE)]
    starting.join()
    runner.generate(1.0)
    print(" ".join(str(j.pid) for j in joiners), flush=True)
    time.sleep(600)
""")


def gone_trial() -> float:
    """Seconds from the application's SIGKILL to every joiner and rank gone."""
    app = subprocess.Popen([sys.executable, "-c", APP.format(repo=REPO)], cwd=REPO,
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        joiners = [int(p) for p in app.stdout.readline().split()]
        everything = [psutil.Process(p) for p in joiners] + \
            [c for p in joiners for c in _children(p)]
        began = time.perf_counter()
        app.kill()
        app.wait()
        alive = everything
        while alive and time.perf_counter() - began < 30:
            alive = [p for p in alive if _running(p)]
            time.sleep(0.002)
        seconds = time.perf_counter() - began
        for proc in alive:
            proc.kill()
        if alive:
            raise RuntimeError(f"{len(alive)} joined processes outlived the application")
        return seconds
    finally:
        app.kill()
        app.wait()


def measure(settings: Settings, results: Results) -> None:
    trials = settings.joined_trials
    times: dict[str, list[float]] = {case: [] for case in (*CASES, GONE)}
    for i in range(trials):
        order = CASES if i % 2 == 0 else tuple(reversed(CASES))
        for case in order:
            try:
                times[case].append(notice_trial(case))
            except Exception as exc:  # noted; the other cases still run
                results.notes.append(f"{OURS}: joined {case} failed: {exc!r}")
        try:
            times[GONE].append(gone_trial())
        except Exception as exc:
            results.notes.append(f"{OURS}: joined {GONE} failed: {exc!r}")
    for case, seconds in times.items():
        if seconds:
            results.put("joined", case, OURS, summarize(seconds))


def rows(results: Results, settings: Settings) -> list[Row]:
    section = (f"Joined ranks' faults (placement=\"external\", world_size {WORLD_SIZE}, "
               f"joined by hand on 127.0.0.1; signal -> runner knows / every rank gone)")
    out = []
    for case in (*CASES, GONE):
        st = results.get("joined", case, OURS)
        goal = GONE_GOAL_S if case == GONE else NOTICE_GOAL_S
        met = None if st is None else st.median <= goal
        out.append(Row(section=section, case=case, unit="s", ours=st,
                       target=f"≤ {goal:g} s", met=met))
    return out
