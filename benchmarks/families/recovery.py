"""Recovery: from a rank SIGKILLed while idle to the next successful call, for (a) a
brand-new runner (the old one shut down), (b) ``restart()`` of a worker without
``rejoin``, (c) ``restart()`` of one with ``rejoin`` (the other ranks keep their model),
also with the victim killed inside an ``all_reduce`` that the other ranks wait in (one
of them still a second from it), and (d) ``restart()`` with one spare, which takes the
victim's place with its one ``load()`` done, at a ``load()`` of 2 s and of 10 s.

The worker's ``load()`` burns ``LOAD_CPU_S`` seconds of CPU per rank, standing for
weights and compilation; its ``generate`` is one ``all_reduce`` over the group.  The
cases are timed in alternating order, so that drift in the machine's load hits all
alike.  Goals: (c) <= 0.5 x (a); (d) <= 0.15 x (a), and (d) at a 10 s ``load()``
within 20 % of (d) at 2 s (recovery does not grow with the model)."""

from __future__ import annotations

import os
import signal
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
SPARE_GOAL = 0.15  # (d) <= SPARE_GOAL x (a)
GROWTH_GOAL = 0.2  # (d) at LONG_LOAD_CPU_S within 20 % of (d) at LOAD_CPU_S
LONG_LOAD_CPU_S = 10.0
CASES = ("new runner", "restart()", "restart() + rejoin()",
         "restart() + rejoin(), killed inside all_reduce", "restart() with a spare",
         f"restart() with a spare, load() {LONG_LOAD_CPU_S:g} s")
LABELS = ("(a)", "(b)", "(c)", "(c)", "(d)", "(d)")
REJOINS = CASES[2:]  # the cases whose worker has rejoin()
SPARED = CASES[4:]  # ... and one spare
INSIDE = CASES[3]
TAKEOVERS = 3  # per runner with a spare


class HeavyLoad(DistributedWorker):
    """load(): LOAD_CPU_S s of CPU; generate(x): sum of x over the ranks (all_reduce)."""

    def load(self, cpu_seconds: float = LOAD_CPU_S) -> None:
        end = time.process_time() + cpu_seconds
        n = 0
        while time.process_time() < end:
            n += 1

    def generate(self, x: float | tuple[int, float], /) -> float:
        """x, or (rank, seconds): that rank sleeps that long before the all_reduce, which
        the others wait in meanwhile."""
        import torch
        import torch.distributed as dist

        if isinstance(x, tuple):
            late, seconds = x
            if self.rank == late:
                time.sleep(seconds)
            x = 1.0
        t = torch.tensor([float(x)])
        dist.all_reduce(t)
        return float(t)

    def reset(self) -> None:
        pass


class HeavyLoadRejoin(HeavyLoad):
    def rejoin(self) -> None:
        pass  # nothing of this model depends on the group


def _runner(case: str):  # -> DistributedRunner
    from reactor_dist import DistributedRunner

    cpu = LONG_LOAD_CPU_S if case == CASES[5] else LOAD_CPU_S
    return DistributedRunner(HeavyLoadRejoin if case in REJOINS else HeavyLoad,
                             world_size=WORLD_SIZE, device="cpu",
                             load_kwargs={"cpu_seconds": cpu},
                             start_timeout=300.0, call_timeout=60.0, shutdown_grace=2.0,
                             spares=1 if case in SPARED else 0)


def trial(case: str) -> list[float]:
    """Seconds from the SIGKILL of an idle rank (or of one inside an all_reduce) to the
    next call's right answer; with a spare, TAKEOVERS of them on one runner (each once
    the last one's successor has loaded: a takeover costs little next to a start)."""
    runners = [_runner(case)]
    try:
        runners[0].start()
        assert runners[0].generate(1.0) == WORLD_SIZE
        if case not in SPARED:
            return [recover(case, runners)]
        seconds = []
        for taken in range(1, TAKEOVERS + 1):
            deadline = time.monotonic() + 120
            while not runners[0].spares_ready and time.monotonic() < deadline:
                time.sleep(0.01)
            seconds.append(recover(case, runners))
            if runners[0].spare_takeovers != taken:
                raise RuntimeError(f"{case}: no spare took the rank's place")
        return seconds
    finally:
        for runner in runners:
            runner.shutdown()


def recover(case: str, runners: list) -> float:
    """One SIGKILL of rank VICTIM and the recovery of ``case``; its seconds."""
    from reactor_dist import WorkerCrashed

    victim = runners[0].ranks[VICTIM].pid
    inside = None
    if case == INSIDE:  # every rank but the next one waits in the all_reduce
        inside = runners[0].submit(((VICTIM + 1) % WORLD_SIZE, 1.0))
        time.sleep(0.3)
    killed = time.perf_counter()
    os.kill(victim, signal.SIGKILL)
    if inside is not None:
        try:
            inside.result()
        except WorkerCrashed:
            pass
    while runners[0].healthy:  # the death watch has seen it
        time.sleep(0.001)
    try:
        runners[0].generate(1.0)
    except (WorkerCrashed, RuntimeError):  # RuntimeError: unusable already
        pass
    if case == CASES[0]:
        runners[0].shutdown()
        runners.append(_runner(case))
        runners[-1].start()
    else:
        runners[0].restart()
    if runners[-1].generate(1.0) != WORLD_SIZE:
        raise RuntimeError(f"{case}: the call after the recovery gave a wrong sum")
    return time.perf_counter() - killed


def measure(settings: Settings, results: Results) -> None:
    cases = CASES[:-1] if settings.quick else CASES  # --quick: no 10 s load()s
    times: dict[str, list[float]] = {case: [] for case in cases}
    for i in range(settings.recovery_trials):
        order = cases if i % 2 == 0 else tuple(reversed(cases))
        for case in order:
            try:
                times[case] += trial(case)
            except Exception as exc:  # noted; the other cases still run
                results.notes.append(f"{OURS}: recovery {case} failed: {exc!r}")
    for case, seconds in times.items():
        if seconds:
            results.put("recovery", case, OURS, summarize(seconds))


def rows(results: Results, settings: Settings) -> list[Row]:
    section = (f"Recovery (world_size {WORLD_SIZE}, load() = {LOAD_CPU_S:g} s of CPU per "
               f"rank, rank {VICTIM} SIGKILLed while idle; kill -> next call answered)")
    fresh = results.get("recovery", CASES[0], OURS)
    spare = results.get("recovery", CASES[4], OURS)
    out = []
    for label, case in zip(LABELS, CASES, strict=True):
        st = results.get("recovery", case, OURS)
        target, met = "", None
        if case in (CASES[2], CASES[4]):
            goal = GOAL if case == CASES[2] else SPARE_GOAL
            target = f"≤ {goal:g} × (a)"
            if st is not None and fresh is not None:
                target += f" (info: {st.median / fresh.median:.2f} × (a))"
                met = st.median <= goal * fresh.median
        elif case == CASES[5]:
            target = f"within {GROWTH_GOAL:.0%} of (d) at {LOAD_CPU_S:g} s"
            if st is not None and spare is not None:
                target += f" (info: {st.median / spare.median:.2f} ×)"
                met = abs(st.median / spare.median - 1) <= GROWTH_GOAL
        out.append(Row(section=section, case=f"{label} {case}", unit="s", ours=st,
                       target=target, met=met))
    return out
