"""restart(), max_restarts and rejoin(), with real processes, sockets and groups.

Every runner here runs ``restart_workers.Reduces`` (or a subclass) on the CPU with the
torch.distributed group on: its answer to a number depends on every rank being back
in one working group, so "the next call returns exactly what a fresh runner returns"
is checked against a brand-new runner's answer for the same input.

The fault matrix (``test_each_fault_then_a_healthy_runner``): each means (SIGKILL,
os._exit, a real SIGSEGV, a hang by SIGSTOP past the timeout, a desync), on rank 0 and
on a rank > 0, at each place (idle, in the middle of a call, inside a collective, in
the middle of a stream), then brought back by ``restart()`` (world_size 2) or by
itself with ``max_restarts=1`` (world_size 3).  One runner goes through the four
places in turn (one fault, one recovery each), so that a cell costs one start and
four restarts.  The bulk is ``slow`` (``make test-slow``); a few cells run in
``make test``.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import time

import psutil
import pytest
from conftest import our_shm_entries, wait_gone
from probe import Probe
from restart_workers import (
    STREAM_ITEMS,
    Arm,
    DiesOnEveryCall,
    FaultAt,
    Pid,
    Reduces,
    ReducesAndRejoins,
)
from sample_workers import InjectedFault, Sleep

from reactor_dist import (
    CallQueueFull,
    DistributedRunner,
    RankDesync,
    WorkerCrashed,
    WorkerTimeout,
)

HANG_TIMEOUT = 2.0  # the call that meets a hang (or a peer stuck in a collective) times out
WAIT = 120.0  # a call behind a restart: generous, two cores import torch in every rank
RESTARTING = "the runner is restarting"


def make_runner(world_size: int = 2, worker: type = Reduces, **kw) -> DistributedRunner:
    worker = kw.pop("worker", worker)
    kw.setdefault("device", "cpu")
    kw.setdefault("call_timeout", 30.0)
    kw.setdefault("start_timeout", 90.0)
    kw.setdefault("shutdown_grace", 1.0)
    return DistributedRunner(worker, world_size=world_size, **kw)


FRESH_XS = range(10)  # every x the tests here compare with a brand-new runner's answer


@functools.cache
def fresh_answers(world_size: int) -> dict[float, tuple[float, ...]]:
    """What a brand-new runner answers to each x in FRESH_XS: Reduces keeps nothing from
    one call to the next, so one new runner (one torch group, not one per x) answers
    them all."""
    with make_runner(world_size) as runner:
        return {x: tuple(runner.generate(x)) for x in FRESH_XS}


def fresh(world_size: int, x: float) -> tuple[float, ...]:
    """What a brand-new runner answers to ``x``."""
    return fresh_answers(world_size)[x]


def answer(runner: DistributedRunner, x: float, **kw) -> tuple[float, ...]:
    return tuple(runner.generate(x, **kw))


def stream_item(world_size: int, i: int) -> list[float]:
    """Item ``i`` of the FaultAt stream: the all_reduce of each rank's arange(4)*(r+1)+i."""
    total = world_size * (world_size + 1) / 2
    return [k * total + world_size * i for k in range(4)]


def expected_error(means: str, where: str) -> type:
    if means == "hang":
        return WorkerTimeout
    if means == "desync":  # in a collective, the others wait for the rank that raised
        return RankDesync if where == "call" else WorkerTimeout
    return WorkerCrashed


def wait_until(check, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.02)
    return False


def gone_or_stopped(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_STOPPED)
    except psutil.NoSuchProcess:
        return True


def make_fault(runner: DistributedRunner, means: str, rank: int, where: str,
               tmp_path) -> tuple[BaseException, list]:
    """Fire one fault; the error of the call that met it, and the stream items that
    arrived before it."""
    timeout = HANG_TIMEOUT if expected_error(means, where) is WorkerTimeout else None
    kw = {"timeout": timeout} if timeout else {}
    items: list = []
    with pytest.raises(Exception) as info:
        if where == "idle":
            trigger = tmp_path / f"trigger-{means}-{rank}"
            assert runner.generate(Arm(means, rank, str(trigger))) == "armed"
            pid = Probe(runner).rank_pids[rank]
            trigger.touch()
            assert wait_until(lambda: gone_or_stopped(pid)), "the armed fault never fired"
            runner.generate(1, **kw)
        elif where == "stream":
            for item in runner.stream(FaultAt(means, rank, where), **kw):
                items.append(item)
        else:
            runner.generate(FaultAt(means, rank, where), **kw)
    return info.value, items


def recovers(runner: DistributedRunner, mode: str, count: int, exc: BaseException,
             x: float) -> None:
    """After the fault: restart() or the runner's own restart gives a healthy runner that
    answers ``x`` as a fresh one does."""
    ws = runner.world_size
    if mode in ("restart", "rejoin", "spare"):
        assert not runner.healthy
        with pytest.raises(RuntimeError, match="unusable"):
            runner.generate(x)
        runner.restart()
        assert runner.healthy
        assert runner.restarts == count
    else:
        assert RESTARTING in str(exc), exc
    assert answer(runner, x, timeout=WAIT) == fresh(ws, x)
    assert runner.restarts == count
    assert runner.stats().restarts == count
    assert runner.healthy


MEANS = ("sigkill", "exit", "segv", "hang", "desync")
WHERE = ("idle", "call", "collective", "stream")
QUICK = {("sigkill", 1, "restart"), ("segv", 0, "restart"), ("exit", 2, "auto"),
         ("desync", 0, "auto"), ("hang", 1, "rejoin")}
# "auto": max_restarts=1, with a restart_window shorter than any restart, so that each of
# the four faults of one lifetime finds the budget free (test_a_crash_loop_... checks it).
# "spare": restart() of a worker with rejoin() and one spare, which takes the failed
# rank's place at each restart (its successor has loaded before the next fault).
MODES = {"restart": dict(max_restarts=0), "rejoin": dict(worker=ReducesAndRejoins),
         "auto": dict(max_restarts=1, restart_window=0.01),
         "spare": dict(worker=ReducesAndRejoins, spares=1)}


def _cells():
    for mode, world_size, ranks in (("restart", 2, (0, 1)), ("auto", 3, (0, 2)),
                                    ("rejoin", 3, (0, 1)), ("spare", 3, (0, 2))):
        for means in MEANS:
            for rank in ranks:
                marks = [pytest.mark.timeout(300)]
                if (means, rank, mode) not in QUICK:
                    marks.append(pytest.mark.slow)
                yield pytest.param(means, rank, mode, world_size, marks=marks,
                                   id=f"{means}-rank{rank}-{mode}-ws{world_size}")


@pytest.mark.parametrize("means, rank, mode, world_size", list(_cells()))
def test_each_fault_then_a_healthy_runner(means, rank, mode, world_size, tmp_path):
    """``rejoin``: restart() of a worker with rejoin(); which survivors keep their process
    depends on where the fault left them (test_with_rejoin_... checks that), but the
    failed rank always gets a new one.  ``spare``: that new one is the spare's, loaded
    before the fault (a desync's rank is alive and keeps its own)."""
    runner = make_runner(world_size, **MODES[mode])
    try:
        runner.start()
        assert answer(runner, 0) == fresh(world_size, 0)
        count = 0
        for where in WHERE:
            if means == "desync" and where == "idle":
                continue  # a desync needs a call
            story = f"{means} on rank {rank} at {where}"
            victim = Probe(runner).rank_pids[rank]
            if mode == "spare":  # the successor of the last one taken has loaded
                deadline = time.monotonic() + WAIT
                while not Probe(runner).ready_spare_pids and time.monotonic() < deadline:
                    time.sleep(0.05)
                [spare] = Probe(runner).ready_spare_pids
            exc, items = make_fault(runner, means, rank, where, tmp_path)
            assert type(exc) is expected_error(means, where), f"{story}: {exc!r}"
            assert items == [stream_item(world_size, i) for i in range(len(items))], story
            assert len(items) <= 2 < STREAM_ITEMS, story
            count += 1
            recovers(runner, mode, count, exc, x=count)
            if means != "desync":
                assert Probe(runner).rank_pids[rank] != victim, story
            if mode == "spare":
                took = means != "desync"
                assert (Probe(runner).rank_pids[rank] == spare) is took, story
                assert runner.spare_takeovers == (count if took else 0), story
    finally:
        runner.shutdown()
    assert not runner.healthy


# -- rejoin() ----------------------------------------------------------------------------------
def lines(path) -> list[int]:
    return [int(x) for x in path.read_text().split()] if path.exists() else []


@pytest.mark.parametrize("victim, noticed", [(0, "in_call"), (2, "in_call"), (1, "at_send")])
def test_with_rejoin_only_the_dead_rank_gets_a_new_process(victim, noticed, tmp_path, caplog):
    """``at_send``: the death is over before the next call, which fails as it is sent
    (the death watch's notice is still unread when restart() begins)."""
    runner = make_runner(3, ReducesAndRejoins, load_kwargs={"state_dir": str(tmp_path)})
    with runner:
        before = runner.generate(Pid())
        assert [(loads, rejoins) for _, loads, rejoins in before] == [(1, 0)] * 3
        pids = [pid for pid, _, _ in before]
        os.kill(pids[victim], signal.SIGKILL)
        if noticed == "at_send":
            assert wait_gone([pids[victim]]) == []
        with pytest.raises(WorkerCrashed, match=f"rank {victim}"):
            runner.generate(Sleep(0, value=1))  # no collective: the survivors stay idle
        with caplog.at_level(logging.WARNING, logger="reactor_dist"):
            runner.restart()
        after = runner.generate(Pid())
        kept = [r for r in range(3) if r != victim]
        for r in kept:  # same process, same worker object: one load(), one rejoin()
            assert after[r] == (pids[r], 1, 1), (r, after[r])
            assert lines(tmp_path / f"load-{r}") == [pids[r]]
            assert lines(tmp_path / f"rejoin-{r}") == [pids[r]]
        new_pid = after[victim][0]
        assert new_pid != pids[victim] and after[victim][1:] == (1, 0)
        assert lines(tmp_path / f"load-{victim}") == [pids[victim], new_pid]
        assert lines(tmp_path / f"rejoin-{victim}") == []
        assert Probe(runner).rank_pids[victim] == new_pid
        assert answer(runner, 5) == fresh(3, 5)  # a collective over the new group
        assert runner.restarts == runner.stats().restarts == 1
        records = [r for r in caplog.records if getattr(r, "restart", None) == 1]
        assert len(records) == 1
        assert records[0].replaced == [victim] and records[0].kept == kept
        assert records[0].restart_seconds > 0  # wall-clock: a restart takes some time
        assert f"rank {victim}" in records[0].getMessage()
        assert "rejoin()" in records[0].getMessage()
    assert wait_gone(pids + [new_pid]) == []


def test_a_survivor_stuck_in_a_collective_is_released_and_kept(tmp_path):
    """Rank 1 raises before an all_reduce that rank 0 then waits in (the group's timeout
    is far beyond shutdown_grace): the restart closes the old group's connections, so
    rank 0 gets out of the collective, answers, and keeps its process and model, as
    rank 1 does."""
    runner = make_runner(2, ReducesAndRejoins, load_kwargs={"state_dir": str(tmp_path)},
                         shutdown_grace=1.0)
    with runner:
        pids = [pid for pid, _, _ in runner.generate(Pid())]
        with pytest.raises(WorkerTimeout, match="no answer from rank 0"):
            runner.generate(FaultAt("desync", 1, "collective"), timeout=HANG_TIMEOUT)
        runner.restart()
        after = runner.generate(Pid())
        assert after == [(pids[0], 1, 1), (pids[1], 1, 1)]
        assert lines(tmp_path / "rejoin-0") == [pids[0]]
        assert lines(tmp_path / "load-0") == [pids[0]]
        assert answer(runner, 2) == fresh(2, 2)
    assert wait_gone(pids) == []


def test_with_rejoin_a_stopped_rank_is_replaced_and_the_others_keep_theirs(tmp_path):
    """A rank that hangs (SIGSTOP: it cannot even answer a signal) does not answer the
    PING within shutdown_grace: it gets a new process; the idle ones are kept."""
    runner = make_runner(3, ReducesAndRejoins, load_kwargs={"state_dir": str(tmp_path)})
    with runner:
        pids = [pid for pid, _, _ in runner.generate(Pid())]
        with pytest.raises(WorkerTimeout, match="no answer from rank 1"):
            runner.generate(FaultAt("hang", 1, "call"), timeout=HANG_TIMEOUT)
        runner.restart()
        after = runner.generate(Pid())
        assert after[0] == (pids[0], 1, 1) and after[2] == (pids[2], 1, 1)
        assert after[1][0] != pids[1] and after[1][1:] == (1, 0)
        assert answer(runner, 7) == fresh(3, 7)
    assert wait_gone(pids + [after[1][0]]) == []


def test_without_rejoin_every_rank_is_restarted(tmp_path):
    runner = make_runner(2, Reduces, load_kwargs={"state_dir": str(tmp_path)})
    with runner:
        pids = [pid for pid, _, _ in runner.generate(Pid())]
        os.kill(pids[1], signal.SIGKILL)
        runner.restart()  # from a runner that has not noticed yet
        after = [pid for pid, _, _ in runner.generate(Pid())]
        assert set(after).isdisjoint(pids)
        assert [len(lines(tmp_path / f"load-{r}")) for r in (0, 1)] == [2, 2]
        assert answer(runner, 3) == fresh(2, 3)
    assert wait_gone(pids + after) == []


# -- restart() that fails ------------------------------------------------------------------------
def ended(runner: DistributedRunner, pids: list[int]) -> None:
    """restart() failed: every rank is ended now, before shutdown()."""
    assert wait_gone(pids + Probe(runner).processes(), timeout=5.0) == []


@pytest.mark.parametrize("worker", [Reduces, ReducesAndRejoins])
def test_load_of_the_replacement_raises(worker, tmp_path):
    marker = tmp_path / "fail-now"
    runner = make_runner(2, worker, load_kwargs={
        "state_dir": str(tmp_path), "load_fault": {"rank": 1, "means": "raise",
                                                   "marker": str(marker)}})
    prefix = Probe(runner).shm_prefix
    try:
        runner.start()
        pids = [pid for pid, _, _ in runner.generate(Pid())]
        marker.touch()
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(InjectedFault, match="injected fault in load on rank 1"):
            runner.restart()
        ended(runner, pids)
        assert not runner.healthy
        with pytest.raises(RuntimeError, match="unusable") as info:
            runner.generate(1)
        assert isinstance(info.value.__cause__, InjectedFault)
        assert runner.restarts == 0
    finally:
        runner.shutdown()
    assert not [n for n in our_shm_entries() if n.startswith(prefix + ".")]


def test_a_replacement_that_dies_while_loading_then_a_second_restart(tmp_path):
    """A fault during restart() itself: WorkerCrashed, every rank ended; once the cause is
    gone, a second restart() brings the runner back."""
    marker = tmp_path / "die-now"
    runner = make_runner(2, ReducesAndRejoins, load_kwargs={
        "state_dir": str(tmp_path), "load_fault": {"rank": 0, "means": "exit",
                                                   "marker": str(marker)}})
    with runner:
        pids = [pid for pid, _, _ in runner.generate(Pid())]
        marker.touch()
        os.kill(pids[0], signal.SIGKILL)
        with pytest.raises(WorkerCrashed, match=r"rank 0 died during restart\(\).*code 3"):
            runner.restart()
        ended(runner, pids)
        with pytest.raises(RuntimeError, match="unusable"):
            runner.generate(1)
        marker.unlink()
        runner.restart()
        assert runner.healthy and runner.restarts == 1
        assert answer(runner, 4) == fresh(2, 4)


def test_restart_on_a_shut_down_or_unstarted_runner_is_refused():
    runner = make_runner(2, init_process_group=False)
    with pytest.raises(RuntimeError, match="start"):
        runner.restart()
    runner.start()
    runner.shutdown()
    with pytest.raises(RuntimeError, match="was shut down"):
        runner.restart()


# -- the restart budget ------------------------------------------------------------------------
def test_a_crash_loop_uses_the_budget_and_stops(tmp_path):
    runner = make_runner(2, DiesOnEveryCall, init_process_group=False, max_restarts=2)
    with runner:
        errors = []
        for i in range(3):
            with pytest.raises(WorkerCrashed, match="rank 1") as info:
                runner.generate(i, timeout=WAIT)
            errors.append(info.value)
        # The automatic restart is told in the message itself (what a log of str() shows).
        assert [RESTARTING in str(e) for e in errors] == [True, True, False]
        assert "restart 1 of max_restarts=2" in str(errors[0])
        assert "restart 2 of max_restarts=2" in str(errors[1])
        assert not any(getattr(e, "__notes__", []) for e in errors)
        with pytest.raises(RuntimeError, match="unusable") as refused:
            runner.generate(9)
        message = str(refused.value)
        assert "3 failures within 600 s, over max_restarts=2" in message
        assert "1. WorkerCrashed" in message and "2. WorkerCrashed" in message
        assert "3. WorkerCrashed" in message
        pids = Probe(runner).rank_pids
        time.sleep(1.0)  # a restart loop would have replaced them by now
        assert Probe(runner).rank_pids == pids
        assert runner.restarts == runner.stats().restarts == 2
        assert not runner.healthy


def test_a_call_behind_a_restart_waits_at_most_its_own_timeout():
    runner = make_runner(2, max_restarts=1)
    with runner:
        pid = Probe(runner).rank_pids[1]
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerCrashed) as info:
            runner.generate(1)
        assert RESTARTING in str(info.value)
        with pytest.raises(CallQueueFull, match="restart"):
            runner.generate(1, timeout=0.001)
        assert answer(runner, 2, timeout=WAIT) == fresh(2, 2)
        assert runner.restarts == 1


# -- calls in flight ---------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["restart", "auto"])
def test_calls_in_flight_at_the_fault_all_fail_and_the_next_one_succeeds(mode):
    runner = make_runner(2, max_in_flight=3, max_restarts=0 if mode == "restart" else 1)
    with runner:
        futures = [runner.submit(FaultAt("sigkill", 1, "collective")),
                   runner.submit(7), runner.submit(8)]
        errors = [f.exception(timeout=60) for f in futures]
        assert [type(e) for e in errors] == [WorkerCrashed] * 3, errors
        if mode == "restart":
            runner.restart()
        else:
            assert all(RESTARTING in str(e) for e in errors)
        assert answer(runner, 9, timeout=WAIT) == fresh(2, 9)
        assert runner.restarts == 1


def test_restart_of_a_healthy_runner_fails_its_calls_in_flight():
    runner = make_runner(2, max_in_flight=2)
    with runner:
        futures = [runner.submit(Sleep(0.5, value="slow")), runner.submit(6)]
        runner.restart()
        for future in futures:
            with pytest.raises(RuntimeError, match="in flight when runner.restart"):
                future.result(timeout=60)
        assert answer(runner, 6) == fresh(2, 6)
        assert runner.restarts == 1


def test_arestart_from_a_task():
    import asyncio

    async def main(runner):
        with pytest.raises(WorkerCrashed):
            await runner.agenerate(FaultAt("exit", 1, "call"))
        await runner.arestart()
        return tuple(await runner.agenerate(1))

    with make_runner(2) as runner:
        assert asyncio.run(main(runner)) == fresh(2, 1)


def test_shutdown_while_the_runner_restarts_itself_leaves_nothing():
    runner = make_runner(2, max_restarts=1)
    runner.start()
    pids = Probe(runner).rank_pids
    try:
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(WorkerCrashed) as info:
            runner.generate(Sleep(0, value=1))
        assert RESTARTING in str(info.value)
    finally:
        runner.shutdown()  # the restart in the background gives up
    every = pids + Probe(runner).rank_pids
    assert wait_gone(every, timeout=5.0) == []
    with pytest.raises(RuntimeError, match="shut down"):
        runner.generate(1)
    with pytest.raises(RuntimeError, match="was shut down"):
        runner.restart()


def test_a_restart_past_its_timeout_then_one_within_it():
    runner = make_runner(2)
    with runner:
        pids = Probe(runner).rank_pids
        with pytest.raises(WorkerTimeout, match=r"restart\(\)"):
            runner.restart(timeout=0.01)  # no replacement can even import torch by then
        ended(runner, pids)
        with pytest.raises(RuntimeError, match="unusable") as info:
            runner.generate(1)
        assert isinstance(info.value.__cause__, WorkerTimeout)
        runner.restart()
        assert answer(runner, 1) == fresh(2, 1)
        assert runner.restarts == 1
