"""Failures as records (issue 30, item 5) and ``runner.ranks`` (item 8): WorkerCrashed,
WorkerTimeout and RankDesync carry one RankFailure per rank involved, with real
processes killed, exited, hung, stopped and raising; ``runner.ranks`` gives the same
record shape (RankInfo) before start, while running, with a dead rank and after
shutdown."""

from __future__ import annotations

import copy
import dataclasses
import os
import pickle
import signal
import socket
import time

import psutil
import pytest
from sample_workers import (
    FAULT,
    Echo,
    ExitsOnRank,
    FailsToLoadOnRank,
    HangsInLoadOnRank,
    HangsOnRank,
    KillsItselfOnRank,
    Raises,
    RaisesPerRank,
    Rank0RaisesOthersHang,
    Say,
    Sleep,
)

from reactor_dist import (
    RankDesync,
    RankFailure,
    RankInfo,
    WorkerCrashed,
    WorkerTimeout,
)

HOST = socket.gethostname()


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        # wall-clock: met in ms on an idle machine (a death or a SIGSTOP taking effect);
        # 10 s is a hang's bound, not a speed's
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def survives_pickle_and_copy(error: BaseException) -> None:
    """The error, its message and its records come back whole from pickle and copy."""
    for again in (pickle.loads(pickle.dumps(error)), copy.copy(error), copy.deepcopy(error)):
        assert type(again) is type(error)
        assert str(again) == str(error)
        assert again.failures == error.failures  # a record's error is not compared
        assert [type(f.error) for f in again.failures] == \
            [type(f.error) for f in error.failures]
        assert [f.error.args if f.error else None for f in again.failures] == \
            [f.error.args if f.error else None for f in error.failures]


def test_a_sigkilled_rank_is_a_record_with_its_pid_signal_output_and_call(runner_for):
    with runner_for(KillsItselfOnRank, 2, load_kwargs={"rank": 1}) as runner:
        assert runner.generate("first") == "first"  # call 1: the fault is call 2
        pid = runner.ranks[1].pid
        with pytest.raises(WorkerCrashed) as info:
            runner.generate(FAULT)
        error = info.value
        assert str(error).startswith(
            f"rank 1 died during generate() (call 2): rank 1 (pid {pid}) killed by SIGKILL "
            f"(the kernel OOM killer sends this too); last output:\n"), str(error)
        (failure,) = error.failures
        assert type(failure) is RankFailure and isinstance(failure, RankInfo)
        assert (failure.rank, failure.pid, failure.host, failure.device, failure.alive) == \
            (1, pid, HOST, "cpu", False)
        assert failure.signal == signal.SIGKILL and failure.signal.name == "SIGKILL"
        assert failure.exitcode is None
        assert failure.stopped is False
        assert failure.error is None
        assert (failure.call_seq, failure.method) == (2, "generate")
        assert failure.output[-1] == "rank 1 about to be signalled"
        survives_pickle_and_copy(error)


def test_an_exit_is_a_record_with_its_exit_code_and_last_lines(runner_for):
    with runner_for(ExitsOnRank, 2, load_kwargs={"rank": 0, "code": 3}) as runner:
        pid = runner.ranks[0].pid
        with pytest.raises(WorkerCrashed) as info:
            runner.generate(FAULT)
        (failure,) = info.value.failures
        assert (failure.rank, failure.pid, failure.alive) == (0, pid, False)
        assert (failure.exitcode, failure.signal) == (3, None)
        assert (failure.call_seq, failure.method) == (1, "generate")
        assert "rank 0 about to exit" in failure.output
        assert "last words of rank 0" in failure.output
        # The record's lines are the message's, as the crash report shows them.
        assert str(info.value).endswith("\n".join(f"    {line}" for line in failure.output))


def test_the_calls_behind_the_failed_one_carry_its_records(runner_for):
    with runner_for(Echo, 2) as runner:
        # Both in flight before the death: the first runs for 30 s, unless its rank dies.
        first, behind = runner.submit(Sleep(30)), runner.submit("never run")
        os.kill(runner.ranks[1].pid, signal.SIGKILL)
        with pytest.raises(WorkerCrashed) as info:
            first.result()
        with pytest.raises(WorkerCrashed) as later:
            behind.result()
        assert later.value is not info.value
        assert later.value.failures == info.value.failures
        assert (info.value.failures[0].call_seq, info.value.failures[0].method) == \
            (1, "generate")


def test_a_death_while_idle_is_a_record_of_no_call(runner_for):
    with runner_for(Echo, 2) as runner:
        pid = runner.ranks[1].pid
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not runner.healthy)
        with pytest.raises(WorkerCrashed, match="rank 1 died during an idle moment") as info:
            runner.generate(1)
        (failure,) = info.value.failures
        assert (failure.rank, failure.pid, failure.signal) == (1, pid, signal.SIGKILL)
        assert (failure.call_seq, failure.method) == (None, None)


def test_a_hang_is_a_timeout_with_the_silent_ranks_records(runner_for):
    with runner_for(HangsOnRank, 2, load_kwargs={"rank": 1}, call_timeout=1.0) as runner:
        pids = [info.pid for info in runner.ranks]
        assert runner.generate(3) == 3
        with pytest.raises(WorkerTimeout,
                           match=r"^no answer from rank 1 within 1 s during generate\(\) "
                                 r"\(call 2\)") as info:
            runner.generate(FAULT)
        (failure,) = info.value.failures
        assert (failure.rank, failure.pid, failure.host, failure.device) == \
            (1, pids[1], HOST, "cpu")
        assert failure.alive is True and failure.stopped is False
        assert (failure.exitcode, failure.signal, failure.error) == (None, None, None)
        assert (failure.call_seq, failure.method) == (2, "generate")
        assert info.value.rank_errors == {}
        survives_pickle_and_copy(info.value)


def test_a_timeout_lists_the_silent_ranks_then_those_that_raised(runner_for):
    with runner_for(Rank0RaisesOthersHang, 2, call_timeout=1.0) as runner:
        with pytest.raises(WorkerTimeout, match="no answer from rank 1 within 1 s") as info:
            runner.generate(FAULT)
        silent, raised = info.value.failures
        assert (silent.rank, silent.alive, silent.stopped, silent.error) == (1, True, False, None)
        assert raised.rank == 0 and raised.alive is True
        assert raised.error is info.value.rank_errors[0]
        assert isinstance(raised.error, ValueError) and raised.error.args == ("rank 0 gave up",)
        assert (silent.call_seq, silent.method) == (raised.call_seq, raised.method) == \
            (1, "generate")
        survives_pickle_and_copy(info.value)


def test_a_stopped_rank_is_a_record_stopped(runner_for):
    with runner_for(Echo, 2, call_timeout=0.5) as runner:
        pid = runner.ranks[1].pid
        os.kill(pid, signal.SIGSTOP)
        wait_for(lambda: psutil.Process(pid).status() == psutil.STATUS_STOPPED)
        try:
            with pytest.raises(WorkerTimeout, match=f"kill -CONT {pid}") as info:
                runner.generate(Say("resumed"))
        finally:
            os.kill(pid, signal.SIGCONT)
        (failure,) = info.value.failures
        assert (failure.rank, failure.pid, failure.alive, failure.stopped) == \
            (1, pid, True, True)
        assert (failure.call_seq, failure.method) == (1, "generate")


def test_a_timeout_in_start_is_a_record_of_no_call(runner_for):
    runner = runner_for(HangsInLoadOnRank, 2, load_kwargs={"rank": 1}, start_timeout=5.0)
    with pytest.raises(WorkerTimeout, match="no answer from rank 1 within 5 s during start"
                       ) as info:
        runner.start()
    (failure,) = info.value.failures
    assert (failure.rank, failure.host, failure.stopped) == (1, HOST, False)
    assert (failure.call_seq, failure.method) == (None, None)
    assert failure.device is None  # its load() never said
    # The ranks are gone: their last records, not alive.
    assert [(i.rank, i.alive) for i in runner.ranks] == [(0, False), (1, False)]
    assert runner.ranks[1].pid == failure.pid


def test_a_desync_carries_the_ranks_that_raised(runner_for):
    with runner_for(Raises, 2, load_kwargs={"error": KeyError, "rank": 1}) as runner:
        pid = runner.ranks[1].pid
        with pytest.raises(RankDesync, match="rank 1 raised KeyError") as info:
            runner.generate(FAULT)
        (failure,) = info.value.failures
        assert (failure.rank, failure.pid, failure.host, failure.device, failure.alive,
                failure.stopped) == (1, pid, HOST, "cpu", True, False)
        assert failure.error is info.value.rank_errors[1] is info.value.__cause__
        assert failure.error.args == ("boom on rank 1",)
        assert (failure.call_seq, failure.method) == (1, "generate")
        assert (failure.exitcode, failure.signal) == (None, None)
        survives_pickle_and_copy(info.value)


def test_a_desync_of_different_types_carries_every_rank(runner_for):
    with runner_for(RaisesPerRank, 2, load_kwargs={"errors": [ValueError, KeyError]}) as runner:
        assert runner.generate(1) == 1
        with pytest.raises(RankDesync) as info:
            runner.generate(FAULT)
        assert [(f.rank, type(f.error), f.call_seq) for f in info.value.failures] == \
            [(0, ValueError, 2), (1, KeyError, 2)]
        assert [f.pid for f in info.value.failures] == [i.pid for i in runner.ranks]


def test_same_exception_everywhere_keeps_the_runner_healthy(runner_for):
    """The records a raising rank's outcome carries cost the healthy row nothing in
    meaning: rank 0's own exception comes back, no RankDesync."""
    with runner_for(Raises, 2) as runner:
        with pytest.raises(ValueError, match="boom on rank 0"):
            runner.generate(FAULT)
        assert runner.healthy


def test_runner_ranks_before_during_and_after(runner_for):
    runner = runner_for(Echo, 2)
    assert runner.ranks == ()
    runner.start()
    ranks = runner.ranks
    assert [(i.rank, i.host, i.device, i.alive) for i in ranks] == \
        [(0, HOST, "cpu", True), (1, HOST, "cpu", True)]
    assert all(type(i) is RankInfo for i in ranks)
    children = {p.pid for p in psutil.Process().children()}
    assert {i.pid for i in ranks} <= children and len({i.pid for i in ranks}) == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        ranks[0].pid = 1  # type: ignore[misc]
    assert runner.ranks == ranks  # a new look, the same records
    runner.shutdown()
    assert runner.ranks == tuple(dataclasses.replace(i, alive=False) for i in ranks)
    assert all(not psutil.pid_exists(i.pid) or psutil.Process(i.pid).status() ==
               psutil.STATUS_ZOMBIE for i in ranks)


def test_runner_ranks_show_a_killed_rank_not_alive(runner_for):
    with runner_for(Echo, 2) as runner:
        before = runner.ranks
        os.kill(before[1].pid, signal.SIGKILL)
        wait_for(lambda: not runner.ranks[1].alive)
        assert runner.ranks == (before[0], dataclasses.replace(before[1], alive=False))
        with pytest.raises(WorkerCrashed):
            runner.generate(1)
        assert [i.alive for i in runner.ranks] == [True, False]


def test_runner_ranks_after_a_failed_start_are_the_last_known(runner_for):
    runner = runner_for(FailsToLoadOnRank, 2, load_kwargs={"rank": 1})
    with pytest.raises(FileNotFoundError):
        runner.start()
    assert [(i.rank, i.host, i.device, i.alive) for i in runner.ranks] == \
        [(0, HOST, None, False), (1, HOST, None, False)]  # no device said by every rank
    assert all(isinstance(i.pid, int) for i in runner.ranks)
