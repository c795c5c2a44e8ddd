"""Hot spares (issue 31, item 2): ``spares=N`` processes load with no rank, and at a
restart each takes the place of a rank whose process is gone, with its one load() and
through rejoin(); a successor starts in the background.  Shown by pids, load()/rejoin()
records and counts, never by timing."""

from __future__ import annotations

import json
import logging
import os
import signal
import time

import psutil
import pytest
from conftest import wait_gone
from prometheus_client import CollectorRegistry, generate_latest
from restart_workers import FaultAt, Pid, Reduces, ReducesAndRejoins, SpareAware, SpareLoadRaises
from test_restart import lines, make_runner
from test_survivors_kept import reduced

from reactor_dist import DistributedRunner, WorkerCrashed, metrics
from reactor_dist.placement.local import RANK_START_ENV

WAIT = 60.0  # for a spare started in the background to load (two cores, torch imports)


def seen(state_dir) -> list[list]:
    """SpareAware's records: [what, pid, rank, is_spare, is_leader, grouped, RANK,
    LOCAL_RANK]."""
    path = os.path.join(str(state_dir), "seen")
    with open(path) as f:
        return [json.loads(line) for line in f]


def spare_pids(state_dir) -> list[int]:
    """The pids of every spare that loaded so far (load() with rank None)."""
    return [pid for what, pid, rank, *_ in seen(state_dir) if what == "load" and rank is None]


def wait_for(predicate, timeout: float = WAIT) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_spares_need_rejoin_a_count_and_a_gpu_each():
    with pytest.raises(ValueError, match=r"spares=1 needs a rejoin\(self\) method on "
                                         r"Reduces: a spare loads with rank None"):
        DistributedRunner(Reduces, world_size=2, spares=1)
    with pytest.raises(ValueError, match=r"spares must be an int >= 0 \(loaded processes "
                                         r"waiting to take a dead rank's place; 0: none\), "
                                         r"got -1"):
        DistributedRunner(ReducesAndRejoins, world_size=2, spares=-1)
    with pytest.raises(ValueError, match="spares must be an int"):
        DistributedRunner(ReducesAndRejoins, world_size=2, spares=True)
    with pytest.raises(ValueError, match=r"gpus=\[0, 1, 2\] names 3 GPUs for 2 ranks and 2 "
                                         r"spares; give one GPU per rank, then one per spare"):
        DistributedRunner(ReducesAndRejoins, world_size=2, spares=2, gpus=[0, 1, 2])
    DistributedRunner(ReducesAndRejoins, world_size=2, spares=0)  # no rejoin() needed


def test_a_spare_loads_with_no_rank_and_takes_the_place_of_the_dead_rank(tmp_path, caplog):
    """world_size 3, one spare, rank 1 SIGKILLed while idle: restart() keeps ranks 0 and 2
    and gives rank 1's place to the spare, which never runs load() again; the answer is
    a fresh runner's; a successor spare loads in the background."""
    runner = make_runner(3, SpareAware, spares=1, load_kwargs={"state_dir": str(tmp_path)})
    with runner:
        pids = [pid for pid, _, _ in runner.generate(Pid())]
        assert runner.spares_ready == 1
        [spare] = spare_pids(tmp_path)
        assert spare not in pids and psutil.Process(spare).ppid() == os.getpid()
        # The spare's load(): no rank, is_spare, not the leader, no torch group, no RANK;
        # the GPU after the ranks' (LOCAL_RANK 3).
        assert [r for r in seen(tmp_path) if r[1] == spare] == \
            [["load", spare, None, True, False, False, None, "3"]]
        os.kill(pids[1], signal.SIGKILL)
        assert wait_gone([pids[1]]) == []
        with caplog.at_level(logging.WARNING, logger="reactor_dist"):
            runner.restart()
        after = runner.generate(Pid())
        assert after == [(pids[0], 1, 1), (spare, 1, 1), (pids[2], 1, 1)]
        assert runner.generate(2.0) == reduced(3, 2.0)
        # It became rank 1 before its rejoin(), inside the new group, on its own GPU;
        # one load() alone.
        assert [r for r in seen(tmp_path) if r[1] == spare] == \
            [["load", spare, None, True, False, False, None, "3"],
             ["rejoin", spare, 1, False, False, True, "1", "3"]]
        assert lines(tmp_path / "load-1") == [pids[1]]
        assert [r.getMessage() for r in caplog.records if getattr(r, "restart", None)] == \
            [r.getMessage() for r in caplog.records
             if "a loaded spare took the place of rank 1 (rejoin(), no load())" in
             r.getMessage() and "rank 0, 2 kept its model" in r.getMessage()]
        assert [r.taken for r in caplog.records if getattr(r, "restart", None)] == [[1]]
        assert runner.spare_takeovers == 1 and runner.stats().spare_takeovers == 1
        assert runner.ranks[1].pid == spare
        # Its successor starts in the background and loads, never as a rank.
        assert wait_for(lambda: runner.spares_ready == 1)
        successor = [p for p in spare_pids(tmp_path) if p != spare]
        assert len(successor) == 1 and successor[0] not in [pid for pid, _, _ in after]
        # ... on the GPU that rank 1 left.
        assert [r[-1] for r in seen(tmp_path) if r[1] == successor[0]] == ["1"]
        assert runner.stats().spares_ready == 1
        assert runner.generate(1.0) == reduced(3, 1.0)
    assert wait_gone(pids + [spare] + successor) == []


def test_an_automatic_restart_gives_rank_0s_place_to_a_spare(tmp_path):
    """max_restarts=1: rank 0 dies in a call; the call fails, the runner restarts itself
    and the spare becomes rank 0 (the leader, whose results cross shared memory)."""
    runner = make_runner(2, SpareAware, spares=1, max_restarts=1,
                         load_kwargs={"state_dir": str(tmp_path)})
    with runner:
        pids = [pid for pid, _, _ in runner.generate(Pid())]
        [spare] = spare_pids(tmp_path)
        with pytest.raises(WorkerCrashed, match="rank 0 died"):
            runner.generate(FaultAt("sigkill", 0, "call"))
        assert runner.generate(Pid(), timeout=120) == [(spare, 1, 1), (pids[1], 1, 1)]
        assert runner.generate(3.0) == reduced(2, 3.0)
        assert [r for r in seen(tmp_path) if r[1] == spare][1] == \
            ["rejoin", spare, 0, False, True, True, "0", "2"]
        assert runner.restarts == 1 and runner.spare_takeovers == 1
        assert wait_for(lambda: runner.spares_ready == 1)
        registry = CollectorRegistry()
        handle = metrics.register(runner, registry, name="spared")
        exposed = generate_latest(registry).decode()
        metrics.unregister(handle)
        assert 'reactor_dist_spares_ready{runner="spared"} 1.0' in exposed
        assert 'reactor_dist_spare_takeovers_total{runner="spared"} 1.0' in exposed
    assert wait_gone(pids + spare_pids(tmp_path)) == []


def test_two_deaths_one_spare_the_other_rank_gets_a_new_process(tmp_path):
    runner = make_runner(3, SpareAware, spares=1, load_kwargs={"state_dir": str(tmp_path)})
    with runner:
        pids = [pid for pid, _, _ in runner.generate(Pid())]
        [spare] = spare_pids(tmp_path)
        for rank in (1, 2):
            os.kill(pids[rank], signal.SIGKILL)
        assert wait_gone(pids[1:]) == []
        runner.restart()
        after = runner.generate(Pid())
        assert after[:2] == [(pids[0], 1, 1), (spare, 1, 1)]
        assert after[2][0] not in pids + [spare] and after[2][1:] == (1, 0)
        assert lines(tmp_path / "load-2") == [pids[2], after[2][0]]
        assert runner.generate(1.0) == reduced(3, 1.0)
    assert wait_gone(pids + spare_pids(tmp_path) + [after[2][0]]) == []


@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
def test_a_spare_that_dies_or_stops_is_replaced_and_logged(tmp_path, caplog, fault):
    """A spare that dies is replaced; one that is stopped (its pipe would fill and hold
    up the ranks' commands) is ended and replaced; the ranks never notice."""
    runner = make_runner(2, SpareAware, spares=1, load_kwargs={"state_dir": str(tmp_path)})
    with runner, caplog.at_level(logging.WARNING, logger="reactor_dist"):
        pids = [pid for pid, _, _ in runner.generate(Pid())]
        [spare] = spare_pids(tmp_path)
        os.kill(spare, getattr(signal, fault))
        assert wait_for(lambda: len(spare_pids(tmp_path)) == 2 and runner.spares_ready == 1)
        assert wait_gone([spare]) == []
        said = "died: spare 2" if fault == "SIGKILL" else "is stopped: it is ended"
        assert [r.getMessage() for r in caplog.records if said in r.getMessage()] != []
        assert [pid for pid, _, _ in runner.generate(Pid())] == pids
        assert runner.healthy and runner.restarts == 0 and runner.spare_takeovers == 0
    assert wait_gone(pids + spare_pids(tmp_path)) == []


def test_shutdown_ends_the_spares_and_leaves_nothing(tmp_path):
    runner = make_runner(2, SpareAware, spares=2, load_kwargs={"state_dir": str(tmp_path)})
    with runner:
        assert runner.spares_ready == 2
        spares = spare_pids(tmp_path)
        assert len(spares) == 2 and all(psutil.pid_exists(p) for p in spares)
    assert runner.spares_ready == 0
    assert wait_gone(spares) == []  # and conftest checks /dev/shm, ipc dirs, processes


def test_a_spares_load_that_raises_fails_start_with_its_exception(tmp_path):
    runner = make_runner(2, SpareLoadRaises, spares=1, load_kwargs={"state_dir": str(tmp_path)})
    with pytest.raises(ValueError, match="this model cannot load without a rank") as info:
        runner.start()
    assert "[spare 2] remote traceback" in str(info.value.__cause__)
    assert runner.closed


def test_a_spare_on_a_ranks_gpu_takes_that_ranks_place_alone():
    """spares.match, the rule that picks the spare for each gone rank: a spare on a GPU
    of its own takes any place; one that shares a rank's GPU takes only that rank's
    (NCCL: one rank per GPU), and a rank takes a spare on its own GPU first."""
    from reactor_dist.caller.spares import Spare, match

    def spares(*places):
        return [Spare(slot, place, None) for slot, place in enumerate(places, start=10)]

    gpus = [0, 1, 0]  # world_size 2; the spare (place 2) on GPU 0, rank 0's
    [on_0] = spares(2)
    assert match([1], [0, 1], [on_0], gpus.__getitem__) == {}
    assert match([0], [0, 1], [on_0], gpus.__getitem__) == {0: on_0}
    assert match([0, 1], [0, 1], [on_0], gpus.__getitem__) == {0: on_0}
    gpus = [0, 1, 2, 0]  # a spare on GPU 2 (its own) and one on GPU 0
    own, shared = spares(2, 3)
    assert match([1], [0, 1], [own, shared], gpus.__getitem__) == {1: own}
    assert match([0], [0, 1], [own, shared], gpus.__getitem__) == {0: shared}
    assert match([0, 1], [0, 1], [own, shared], gpus.__getitem__) == {0: shared, 1: own}
    assert match([1], [0, 1], [shared], gpus.__getitem__) == {}
    # Once rank 0 moved to GPU 2, GPU 0 holds no rank: its spare may take rank 1's place.
    assert match([1], [2, 1], [shared], gpus.__getitem__) == {1: shared}
    # Without gpus= each place is a GPU of its own: the first ranks get the spares.
    a, b = spares(3, 4)
    assert match([0, 2], [0, 1, 2], [a, b], lambda p: p) == {0: a, 2: b}
    assert match([0, 1, 2], [0, 1, 2], [a], lambda p: p) == {0: a}


def test_a_spare_sharing_rank_0s_gpu_waits_for_rank_0_alone(tmp_path, monkeypatch):
    """gpus=[0, 1, 0] on the CPU: every process is given CUDA_VISIBLE_DEVICES="0,1" (no
    GPU id twice) and the spare GPU index 0 (LOCAL_RANK), rank 0's; rank 1 SIGKILLed:
    rank 1 loads again in its place and the spare stays a spare; rank 0 SIGKILLed: the
    spare takes its place, and its successor waits on GPU 0 again.  The processes are
    spawned, not forked, so that /proc shows the environment each was given."""
    monkeypatch.setenv(RANK_START_ENV, "spawn")
    runner = make_runner(2, SpareAware, spares=1, gpus=[0, 1, 0],
                         load_kwargs={"state_dir": str(tmp_path)})
    with runner:
        pids = [pid for pid, _, _ in runner.generate(Pid())]
        assert runner.spares_ready == 1
        [spare] = spare_pids(tmp_path)
        for pid in [*pids, spare]:
            assert psutil.Process(pid).environ()["CUDA_VISIBLE_DEVICES"] == "0,1"
        assert [r for r in seen(tmp_path) if r[1] == spare] == \
            [["load", spare, None, True, False, False, None, "0"]]
        os.kill(pids[1], signal.SIGKILL)
        assert wait_gone([pids[1]]) == []
        runner.restart()
        after = runner.generate(Pid())
        assert after[0] == (pids[0], 1, 1) and after[1][1:] == (1, 0)
        assert after[1][0] not in (pids[1], spare)  # a new process loaded as rank 1
        assert runner.spare_takeovers == 0 and runner.spares_ready == 1
        assert spare_pids(tmp_path) == [spare] and psutil.Process(spare).is_running()
        assert runner.generate(2.0) == reduced(2, 2.0)
        os.kill(pids[0], signal.SIGKILL)
        assert wait_gone([pids[0]]) == []
        runner.restart()
        again = runner.generate(Pid())
        assert again == [(spare, 1, 1), (after[1][0], 1, 1)]
        assert runner.spare_takeovers == 1 and runner.ranks[0].pid == spare
        assert [r for r in seen(tmp_path) if r[1] == spare][-1] == \
            ["rejoin", spare, 0, False, True, True, "0", "0"]
        assert runner.generate(1.0) == reduced(2, 1.0)
        assert wait_for(lambda: runner.spares_ready == 1)
        [successor] = [p for p in spare_pids(tmp_path) if p != spare]
        assert [r[-1] for r in seen(tmp_path) if r[1] == successor] == ["0"]
        assert psutil.Process(successor).environ()["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert wait_gone([*pids, after[1][0], spare, successor]) == []
