"""Every live survivor is kept (issue 31, item 1): at a restart each survivor gets out of
whatever collective of the failed step it waits in (the old group's connections close
on all of them at once, reactor_dist.rank.group) and keeps its process and its one load();
only a rank that cannot answer for a reason of its own (a hang in the model's code) is
replaced.  Shown by pids and load()/rejoin() counts, never by timing."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import threading

import pytest
from conftest import wait_gone
from restart_workers import DieIn, HangIn, Pid, ReducesAndRejoins
from test_restart import HANG_TIMEOUT, lines, make_runner

from reactor_dist import WorkerCrashed, WorkerTimeout

OPS = ("all_reduce", "all_gather", "broadcast")


def victims(world_size: int) -> tuple[int, ...]:
    return (0, world_size // 2, world_size - 1)  # rank 0, a middle rank, the last


def reduced(world_size: int, x: float) -> list[float]:
    """ReducesAndRejoins' answer to ``x``: a collective over one working group."""
    return [i * world_size * (world_size + 1) / 2 + world_size * x for i in range(4)]


MATRIX = [(ws, victim, when, op, n)
          for ws in (3, 4) for victim in victims(ws) for when, op, n in
          itertools.product(("before", "inside"), OPS, (1, 4096))]
# make test: every world size, victim, moment, collective and size at least once.
QUICK = [(3, 0, "before", "all_reduce", 1), (3, 1, "inside", "all_gather", 4096),
         (3, 2, "before", "broadcast", 4096), (4, 0, "inside", "broadcast", 1),
         (4, 2, "before", "all_gather", 1), (4, 3, "inside", "all_reduce", 4096)]


def check_every_survivor_kept(world_size, victim, when, op, n, tmp_path):
    runner = make_runner(world_size, ReducesAndRejoins,
                         load_kwargs={"state_dir": str(tmp_path)})
    with runner:
        pids = [pid for pid, _, _ in runner.generate(Pid())]
        with pytest.raises(WorkerCrashed, match=f"rank {victim} died"):
            runner.generate(DieIn(victim, when, op, n))
        runner.restart()
        after = runner.generate(Pid())
        for rank in range(world_size):
            if rank != victim:  # the same process and worker: one load(), one rejoin()
                assert after[rank] == (pids[rank], 1, 1), (rank, after[rank])
                assert lines(tmp_path / f"load-{rank}") == [pids[rank]]
        assert after[victim][0] != pids[victim] and after[victim][1:] == (1, 0)
        assert runner.generate(2.0) == reduced(world_size, 2.0)
        assert runner.stats().restarts == 1
    assert wait_gone(pids + [after[victim][0]]) == []


@pytest.mark.parametrize("world_size, victim, when, op, n", QUICK)
def test_every_live_survivor_keeps_its_process_and_model(world_size, victim, when, op, n,
                                                          tmp_path):
    check_every_survivor_kept(world_size, victim, when, op, n, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("world_size, victim, when, op, n",
                         [case for case in MATRIX if case not in QUICK])
def test_every_live_survivor_kept_the_whole_matrix(world_size, victim, when, op, n,
                                                   tmp_path):
    check_every_survivor_kept(world_size, victim, when, op, n, tmp_path)


def test_a_rank_that_hangs_in_the_models_own_code_is_replaced(tmp_path):
    """Rank 1 sleeps inside generate() (no collective to be released from): it cannot
    answer the restart's PING within shutdown_grace, so it gets a new process; the
    others, which returned, keep theirs."""
    runner = make_runner(3, ReducesAndRejoins, load_kwargs={"state_dir": str(tmp_path)})
    with runner:
        pids = [pid for pid, _, _ in runner.generate(Pid())]
        with pytest.raises(WorkerTimeout, match="no answer from rank 1"):
            runner.generate(HangIn(1), timeout=HANG_TIMEOUT)
        runner.restart()
        after = runner.generate(Pid())
        assert after[0] == (pids[0], 1, 1) and after[2] == (pids[2], 1, 1)
        assert after[1][0] != pids[1] and after[1][1:] == (1, 0)
        assert runner.generate(1.0) == reduced(3, 1.0)
    assert wait_gone(pids + [after[1][0]]) == []


def test_a_rank_known_dead_is_not_waited_for(tmp_path):
    """Rank 2 is stopped as restart() begins (alive, silent) and SIGKILLed a second into
    the restart's grace PING: it is left out of the wait as soon as its death is known,
    replaced, and both survivors kept.  shutdown_grace is 60 s: a wait for the dead
    rank through the grace would outlast the restart's own 30 s (WorkerTimeout)."""
    runner = make_runner(3, ReducesAndRejoins, load_kwargs={"state_dir": str(tmp_path)},
                         shutdown_grace=60.0)
    with runner:
        pids = [pid for pid, _, _ in runner.generate(Pid())]
        os.kill(pids[2], signal.SIGSTOP)
        kill = threading.Timer(1.0, os.kill, (pids[2], signal.SIGKILL))
        kill.start()
        try:
            runner.restart(timeout=30)
        finally:
            kill.cancel()
            with contextlib.suppress(ProcessLookupError):
                os.kill(pids[2], signal.SIGKILL)
        after = runner.generate(Pid())
        assert [after[r] for r in (0, 1)] == [(pids[0], 1, 1), (pids[1], 1, 1)]
        assert after[2][0] != pids[2]
    assert wait_gone(pids + [after[2][0]]) == []


def test_restarts_that_replace_nobody_say_so_and_leave_no_old_store(tmp_path, caplog):
    """Three restarts of a healthy runner keep every rank: each record says who was kept
    and names no replaced rank, and the private directory holds the last generation's
    store alone (an old generation's file goes with it)."""
    import logging

    from probe import Probe

    runner = make_runner(2, ReducesAndRejoins, load_kwargs={"state_dir": str(tmp_path)})
    with runner:
        pids = [pid for pid, _, _ in runner.generate(Pid())]
        with caplog.at_level(logging.WARNING, logger="reactor_dist"):
            for _ in range(3):
                runner.restart()
        records = [r.getMessage() for r in caplog.records if getattr(r, "restart", None)]
        assert len(records) == 3
        assert all("rank 0, 1 kept its model (rejoin())" in m and "new process" not in m
                   for m in records), records
        stores = sorted(n for n in os.listdir(Probe(runner).ipc_dir) if n.startswith("store"))
        assert stores == ["store.3"]
        assert [pid for pid, _, _ in runner.generate(Pid())] == pids
        assert runner.generate(1.0) == reduced(2, 1.0)
    assert wait_gone(pids) == []


def blocked_in_every_thread(pid: int, sig: int) -> list[bool]:
    """For each thread of process ``pid``: whether ``sig`` is in its blocked mask."""
    found = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/status") as f:
            mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigBlk:"))
        found.append(bool(mask & (1 << (int(sig) - 1))))
    return found


def test_threads_a_library_starts_at_import_never_take_the_abort_signal(tmp_path):
    """With OPENBLAS_NUM_THREADS=4 numpy's OpenBLAS starts threads as the package
    imports numpy, before the rank's own code runs: the signal is blocked in every one
    of them (the rank's command blocks it first), so at a restart it releases the
    survivors instead of ending them (its default action).  One thread shows it
    unblocked: the abort thread, inside sigwait (the kernel unblocks what a thread
    waits for there)."""
    from reactor_dist.wire.protocol import GROUP_ABORT_SIGNAL

    runner = make_runner(3, ReducesAndRejoins, load_kwargs={"state_dir": str(tmp_path)},
                         env={"OPENBLAS_NUM_THREADS": "4"})
    with runner:
        pids = [pid for pid, _, _ in runner.generate(Pid())]
        for pid in pids:
            blocked = blocked_in_every_thread(pid, GROUP_ABORT_SIGNAL)
            assert len(blocked) >= 6 and blocked.count(False) == 1, (pid, blocked)
        os.kill(pids[1], signal.SIGKILL)
        assert wait_gone([pids[1]]) == []
        runner.restart()
        after = runner.generate(Pid())
        assert after[0] == (pids[0], 1, 1) and after[2] == (pids[2], 1, 1)
        assert runner.generate(1.0) == reduced(3, 1.0)
    assert wait_gone(pids + [after[1][0]]) == []
