"""Recovery: from a rank SIGKILLed while idle to the next successful call, for (a) a
brand-new runner (the old one shut down), (b) ``restart()`` of a worker without
``rejoin``, (c) ``restart()`` of one with ``rejoin`` (the other ranks keep their model).

The worker's ``load()`` burns ``LOAD_CPU_S`` seconds of CPU per rank, standing for
weights and compilation; its ``generate`` is one ``all_reduce`` over the group.  The
three are timed in alternating order, so that drift in the machine's load hits all
alike.  Goal: (c) <= 0.5 x (a)."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time

from benchmarks.config import Settings
from benchmarks.implementations.pools import OURS
from benchmarks.report.results import Results, Row
from benchmarks.report.stats import summarize
from reactor_dist import DistributedWorker

WORLD_SIZE = 4
LOAD_CPU_S = 2.0
VICTIM = 2  # the rank killed
GOAL = 0.5  # (c) <= GOAL x (a)
CASES = ("new runner", "restart()", "restart() + rejoin()")


class HeavyLoad(DistributedWorker):
    """load(): LOAD_CPU_S s of CPU; generate(x): sum of x over the ranks (all_reduce)."""

    def load(self, pid_dir: str, cpu_seconds: float = LOAD_CPU_S) -> None:
        end = time.process_time() + cpu_seconds
        n = 0
        while time.process_time() < end:
            n += 1
        with open(os.path.join(pid_dir, f"rank{self.rank}.pid"), "w") as f:
            f.write(str(os.getpid()))

    def generate(self, x: float, /) -> float:
        import torch
        import torch.distributed as dist

        t = torch.tensor([float(x)])
        dist.all_reduce(t)
        return float(t)

    def reset(self) -> None:
        pass


class HeavyLoadRejoin(HeavyLoad):
    def rejoin(self) -> None:
        pass  # nothing of this model depends on the group


def _runner(cls: type, pid_dir: str):  # -> DistributedRunner
    from reactor_dist import DistributedRunner

    return DistributedRunner(cls, world_size=WORLD_SIZE, device="cpu",
                             load_kwargs={"pid_dir": pid_dir}, start_timeout=300.0,
                             call_timeout=60.0, shutdown_grace=2.0)


def trial(case: str) -> float:
    """Seconds from the SIGKILL of an idle rank to the next call's right answer."""
    from reactor_dist import WorkerCrashed

    pid_dir = tempfile.mkdtemp(prefix=f"rdbench-{os.getpid()}-recovery-")
    cls = HeavyLoadRejoin if case == CASES[2] else HeavyLoad
    runners = [_runner(cls, pid_dir)]
    try:
        runners[0].start()
        assert runners[0].generate(1.0) == WORLD_SIZE
        with open(os.path.join(pid_dir, f"rank{VICTIM}.pid")) as f:
            victim = int(f.read())
        killed = time.perf_counter()
        os.kill(victim, signal.SIGKILL)
        while runners[0].healthy:  # the death watch has seen it
            time.sleep(0.001)
        try:
            runners[0].generate(1.0)
        except WorkerCrashed:
            pass
        if case == CASES[0]:
            runners[0].shutdown()
            runners.append(_runner(cls, pid_dir))
            runners[-1].start()
        else:
            runners[0].restart()
        if runners[-1].generate(1.0) != WORLD_SIZE:
            raise RuntimeError(f"{case}: the call after the recovery gave a wrong sum")
        return time.perf_counter() - killed
    finally:
        for runner in runners:
            runner.shutdown()
        shutil.rmtree(pid_dir, ignore_errors=True)


def measure(settings: Settings, results: Results) -> None:
    times: dict[str, list[float]] = {case: [] for case in CASES}
    for i in range(settings.recovery_trials):
        order = CASES if i % 2 == 0 else tuple(reversed(CASES))
        for case in order:
            try:
                times[case].append(trial(case))
            except Exception as exc:  # noted; the other cases still run
                results.notes.append(f"{OURS}: recovery {case} failed: {exc!r}")
    for case, seconds in times.items():
        if seconds:
            results.put("recovery", case, OURS, summarize(seconds))


def rows(results: Results, settings: Settings) -> list[Row]:
    section = (f"Recovery (world_size {WORLD_SIZE}, load() = {LOAD_CPU_S:g} s of CPU per "
               f"rank, rank {VICTIM} SIGKILLed while idle; kill -> next call answered)")
    fresh = results.get("recovery", CASES[0], OURS)
    out = []
    for label, case in zip(("(a)", "(b)", "(c)"), CASES, strict=True):
        st = results.get("recovery", case, OURS)
        target, met = "", None
        if case == CASES[2]:
            target = f"≤ {GOAL:g} × (a)"
            if st is not None and fresh is not None:
                target += f" (info: {st.median / fresh.median:.2f} × (a))"
                met = st.median <= GOAL * fresh.median
        out.append(Row(section=section, case=f"{label} {case}", unit="s", ours=st,
                       target=target, met=met))
    return out
