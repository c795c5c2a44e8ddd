"""While the runner restarts, every call form waits for it; an interrupt anywhere in a
restart leaves a runner that restarts and shuts down at once (issue 30, item 2).

The runner here restarts itself (``max_restarts=1``) after rank 1 is SIGKILLed, and
the replacement's ``load()`` lasts ``RELOAD`` seconds (``Reduces(reload_seconds=)``), so
a call made right after the crash is made while the runner restarts: the test checks
that (``state=restarting``) before it calls.  Each form must then wait and return what a
fresh runner returns, a call that was already waiting for its turn when the runner
broke included.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time

import pytest
from conftest import wait_gone
from pipeline_workers import NapOn
from probe import Probe
from restart_workers import FaultAt, Reduces

from reactor_dist import CallQueueFull, DistributedRunner, WorkerCrashed
from reactor_dist.caller import restart
from reactor_dist.caller.engine import MOVES, State
from reactor_dist.caller.supervisor import Supervisor

RELOAD = 1.5  # seconds the replacement's load() takes
WAIT = 120.0  # a call behind a restart: two cores import torch in the new rank


def reduced(x: float) -> list[float]:
    return [float(sum(i * (r + 1) + x for r in range(2))) for i in range(4)]


def restarting_runner(tmp_path, **kw) -> DistributedRunner:
    kw.setdefault("max_restarts", 1)
    return DistributedRunner(Reduces, world_size=2, device="cpu", call_timeout=WAIT,
                             start_timeout=WAIT, shutdown_grace=1.0,
                             load_kwargs={"state_dir": str(tmp_path), "reload_seconds": RELOAD},
                             **kw)


def crash_and_restart(runner: DistributedRunner) -> None:
    """Rank 1 dies in a call; the runner is restarting itself when this returns."""
    with pytest.raises(WorkerCrashed) as info:
        runner.generate(FaultAt("sigkill", 1, "call"))
    assert "the runner is restarting" in str(info.value)
    assert "state=restarting" in repr(runner)  # the replacement sleeps RELOAD in load()


def in_thread_forms(runner: DistributedRunner, form: str):
    if form == "generate":
        return runner.generate(5.0)
    if form == "submit":
        return runner.submit(5.0).result(timeout=WAIT)
    if form == "stream":
        return list(runner.stream(5.0))
    if form == "reset":
        return runner.reset()
    if form == "wait_idle":
        return runner.wait_idle(WAIT)
    raise AssertionError(form)


async def in_task_forms(runner: DistributedRunner, form: str):
    if form == "agenerate":
        return await runner.agenerate(5.0)
    if form == "astream":
        return [item async for item in runner.astream(5.0)]
    if form == "areset":
        return await runner.areset()
    if form == "await_idle":
        return await runner.await_idle(WAIT)
    raise AssertionError(form)


EXPECTED = {"generate": reduced(5.0), "submit": reduced(5.0), "stream": [reduced(5.0)],
            "reset": None, "wait_idle": True, "agenerate": reduced(5.0),
            "astream": [reduced(5.0)], "areset": None, "await_idle": True}


@pytest.mark.parametrize("form", list(EXPECTED))
def test_every_call_form_made_during_an_automatic_restart_waits_for_it(form, tmp_path):
    with restarting_runner(tmp_path) as runner:
        crash_and_restart(runner)
        if form.startswith("a"):
            got = asyncio.run(in_task_forms(runner, form))
        else:
            got = in_thread_forms(runner, form)
        assert got == EXPECTED[form]
        assert runner.restarts == 1 and runner.healthy
        assert runner.generate(2.0) == reduced(2.0)


@pytest.mark.parametrize("form", ["submit", "stream", "agenerate"])
def test_a_call_waiting_for_its_turn_when_the_runner_broke_waits_for_the_restart(form,
                                                                               tmp_path):
    """max_in_flight=1: the call waits for its turn behind a call in which rank 1 dies
    after 0.5 s; it is sent once the runner is back, and returns its own result."""
    with restarting_runner(tmp_path, max_in_flight=1) as runner:
        first = runner.submit(FaultAt("sigkill", 1, "collective"))
        got: list = []
        if form == "agenerate":
            async def behind():
                return await runner.agenerate(5.0)
            waiter = threading.Thread(target=lambda: got.append(asyncio.run(behind())))
        elif form == "stream":
            waiter = threading.Thread(target=lambda: got.append(list(runner.stream(5.0))))
        else:
            waiter = threading.Thread(
                target=lambda: got.append(runner.submit(5.0).result(timeout=WAIT)))
        waiter.start()
        with pytest.raises(WorkerCrashed):
            first.result(timeout=WAIT)
        waiter.join(WAIT)
        assert not waiter.is_alive()
        assert got == [[reduced(5.0)] if form == "stream" else reduced(5.0)]
        assert runner.restarts == 1 and runner.healthy


def test_queue_timeout_bounds_the_wait_for_a_turn_restart_included(tmp_path):
    with restarting_runner(tmp_path) as runner:
        crash_and_restart(runner)
        with pytest.raises(CallQueueFull, match=r"waited 0 s for the runner's restart"):
            runner.generate(1.0, queue_timeout=0)
        assert runner.generate(1.0, queue_timeout=None) == reduced(1.0)


def test_queue_timeout_zero_drops_a_call_at_once_and_the_sent_ones_keep_call_timeout():
    """Back-pressure: submit(x, queue_timeout=0) raises CallQueueFull at once when the
    queue is full, the runner stays healthy, and the calls that got a place run under
    call_timeout (5 s), not under the 0 s wait: each naps 0.5 s on rank 0."""
    with DistributedRunner(Reduces, world_size=2, device="cpu", call_timeout=5.0,
                           max_in_flight=2) as runner:
        sent = [runner.submit(NapOn(0, 0.5, i), queue_timeout=0) for i in range(2)]
        with pytest.raises(CallQueueFull, match=r"waited 0 s for its turn"):
            runner.submit(NapOn(0, 0.5, 2), queue_timeout=0)
        assert [f.result(timeout=30) for f in sent] == [0, 1]
        assert runner.healthy and runner.generate(1.0) == reduced(1.0)


# -- an interrupt anywhere in a restart ---------------------------------------------------
def interrupt_inside(monkeypatch, owner, name: str) -> None:
    """SIGINT to this process as ``owner.name`` is entered (once): Python raises the
    KeyboardInterrupt there, in the main thread, as a Ctrl-C would."""
    original = getattr(owner, name)
    fired = []

    def interrupted(*args, **kwargs):
        if not fired and threading.current_thread() is threading.main_thread():
            fired.append(True)
            signal.raise_signal(signal.SIGINT)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, interrupted)


class InterruptOnRestartRecord(logging.Handler):
    """A slow log handler (20 ms) that is interrupted inside the restart's record."""

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "restart", None) is not None:
            time.sleep(0.02)
            signal.raise_signal(signal.SIGINT)


def interrupt_in_reload(tmp_path) -> threading.Thread:
    """SIGINT once rank 1's replacement is inside its (RELOAD s) load()."""
    def watch():
        path = tmp_path / "load-1"
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            if path.exists() and len(path.read_text().split()) >= 2:
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.01)
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


POINTS = ["replace", "ping", "reload", "log record"]


@pytest.mark.parametrize("then", ["restart", "shutdown"])
@pytest.mark.parametrize("point", POINTS)
def test_an_interrupt_anywhere_in_restart_leaves_a_runner_that_restarts_and_shuts_down(
        point, then, tmp_path, monkeypatch):
    runner = restarting_runner(tmp_path, max_restarts=0)
    logger = logging.getLogger("reactor_dist")
    handler = InterruptOnRestartRecord()
    with runner:
        pids = Probe(runner).rank_pids
        with pytest.raises(WorkerCrashed):
            runner.generate(FaultAt("sigkill", 1, "call"))
        watcher = None
        if point == "replace":
            interrupt_inside(monkeypatch, restart, "replace")
        elif point == "ping":
            interrupt_inside(monkeypatch, Supervisor, "ping")
        elif point == "reload":
            watcher = interrupt_in_reload(tmp_path)
        else:
            logger.addHandler(handler)
        try:
            with pytest.raises(KeyboardInterrupt):
                runner.restart()
        finally:
            logger.removeHandler(handler)
            monkeypatch.undo()
        if watcher is not None:
            watcher.join(WAIT)
        assert "state=unusable" in repr(runner)
        with pytest.raises(RuntimeError, match="unusable: KeyboardInterrupt"):
            runner.generate(1.0)
        if then == "restart":
            runner.restart()
            assert runner.generate(3.0) == reduced(3.0) and runner.healthy
        new_pids = Probe(runner).rank_pids
    assert "state=closed" in repr(runner)
    assert wait_gone(pids + new_pids, timeout=10.0) == []


def test_an_illegal_move_is_a_bug_that_raises():
    runner = DistributedRunner(Reduces, world_size=1, device="cpu")
    engine = Probe(runner).engine
    assert State.RESTARTING not in MOVES[State.NEW]
    with pytest.raises(RuntimeError, match="cannot move from new to restarting"):
        engine.move(State.RESTARTING)
    assert engine.state is State.NEW
    runner.shutdown()
    assert engine.state is State.CLOSED and MOVES[State.CLOSED] == frozenset()
