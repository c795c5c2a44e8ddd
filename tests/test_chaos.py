"""Chaos (slow): 30 runner lifetimes, each killing a random rank at a random
moment of a random call.

Every call either returns its correct result or raises a documented error within
its bound: ``WorkerCrashed`` (naming the rank and the signal) within 3 s of the kill
or of the call's start, whichever is later; after that, ``RuntimeError`` "unusable"
at once.  No call may time out (nothing hangs here) and after ``shutdown()`` no
process, /dev/shm entry or ipc directory is left.  The seed is printed; rerun one
with ``CHAOS_SEED=<seed> make test-slow``.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import numpy as np
import pytest
from conftest import wait_gone
from probe import Probe
from sample_workers import Echo, FullArray, SharedArray, Sleep, SpawnChild

from reactor_dist import DistributedRunner, WorkerCrashed
from reactor_dist.shm import segments

LIFETIMES = 30
# From the kill (or the call's start) to WorkerCrashed: most under 0.1 s, the slowest
# 0.2-0.35 s on an idle machine (and 1.7 s seen with the machine loaded 7x over), so 3 s
# is 8x that; a kill not seen would be the 10 s call_timeout's WorkerTimeout.
BOUND = 3.0
SIGNALS = [signal.SIGKILL, signal.SIGKILL, signal.SIGTERM, signal.SIGSEGV]


def random_call(rng: random.Random, runner: DistributedRunner, i: int):
    """One random call: (what it is, a function making it, a check of its result)."""
    kind = rng.choice(["echo", "input", "array", "shared", "sleep", "reset", "child"])
    if kind == "echo":
        value = ("echo", i, "x" * rng.randrange(100))
        return kind, lambda: runner.generate(value), lambda out: out == value
    if kind == "input":
        value = np.full(rng.choice([1 << 10, 2 << 20]), i % 200, np.uint8)
        return kind, lambda: runner.generate(value), lambda out: np.array_equal(out, value)
    if kind in ("array", "shared"):
        n = rng.choice([1 << 10, 4 << 20, 8 << 20])
        step = (FullArray if kind == "array" else SharedArray)([n], fill=i % 200)
        return kind, lambda: runner.generate(step), \
            lambda out: out.shape == (n,) and int(out[0]) == int(out[-1]) == i % 200
    if kind == "sleep":
        step = Sleep(rng.uniform(0.01, 0.1), value=i)
        return kind, lambda: runner.generate(step), lambda out: out == i
    if kind == "reset":
        return kind, runner.reset, lambda out: out is None
    return kind, lambda: runner.generate(SpawnChild()), lambda out: out > 0


def lifetime(rng: random.Random, life: int) -> str:
    world_size = rng.choice([2, 2, 3])
    runner = DistributedRunner(Echo, world_size=world_size, init_process_group=False,
                               device="cpu", call_timeout=10)
    try:
        runner.start()
        probe = Probe(runner)
        prefix, ipc_dir = probe.shm_prefix, probe.ipc_dir
        calls = rng.randint(2, 10)
        victim_call, victim = rng.randrange(calls), rng.randrange(world_size)
        delay, sig = rng.uniform(0, 0.06), rng.choice(SIGNALS)
        pid = probe.rank_pids[victim]
        kill: dict[str, float] = {}

        def killer() -> None:
            time.sleep(delay)
            kill["at"] = time.monotonic()
            os.kill(pid, sig)

        story = f"life {life}: ws {world_size}, kill rank {victim} with {sig.name} " \
                f"{delay * 1000:.0f} ms into call {victim_call}/{calls}"
        thread = threading.Thread(target=killer)
        crashed = False
        for i in range(calls + 1):
            if i == victim_call:
                thread.start()
            if i == calls:  # one more call after the plan: the kill has happened by now
                thread.join()
            kind, call, correct = random_call(rng, runner, i)
            started = time.monotonic()
            try:
                out = call()
            except WorkerCrashed as exc:
                elapsed = time.monotonic() - max(started, kill.get("at", started))
                assert "at" in kill and not crashed, f"{story}: unexpected {exc!r}"
                # wall-clock: BOUND says why (8x the slowest on an idle machine)
                assert elapsed < BOUND, f"{story}: WorkerCrashed {elapsed:.2f} s late"
                assert f"rank {victim}" in str(exc) and sig.name in str(exc), f"{story}: {exc}"
                crashed = True
            except RuntimeError as exc:
                assert crashed and "unusable" in str(exc), f"{story}: {exc!r}"
                # wall-clock: refused at once: under 1 ms on an idle machine, 0.25 s is 250x
                # that; a call sent to the dead ranks would wait for the 10 s call_timeout
                assert time.monotonic() - started < 0.25
            else:
                assert correct(out), f"{story}: wrong result of {kind} call {i}"
                del out
        assert crashed, f"{story}: the kill was never reported"
        assert not runner.healthy
        pids = probe.processes()
    finally:
        runner.shutdown()
    assert wait_gone(pids, timeout=1.0) == [], f"{story}: processes left"
    assert not [n for n in os.listdir(segments.DEFAULT_DIR) if n.startswith(prefix + ".")], story
    assert not os.path.exists(ipc_dir), story
    return story


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_chaos_30_lifetimes_each_losing_a_rank():
    seed = int(os.environ.get("CHAOS_SEED", random.randrange(1 << 32)))
    print(f"\nCHAOS_SEED={seed}")
    rng = random.Random(seed)
    for life in range(LIFETIMES):
        print(lifetime(rng, life))
