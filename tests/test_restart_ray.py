"""restart() with placement="ray", on test_ray's simulated two-node cluster: the remote
rank starts again through its RankHost, in its bundle, on its node."""

from __future__ import annotations

import os
import signal

import pytest
from conftest import wait_gone
from probe import Probe
from restart_workers import Pid, ReducesAndRejoins, SpareAware
from test_ray import cluster, live_hosts, nothing_reserved, placed_runner, wait_full  # noqa: F401
from test_restart import fresh
from test_spares import seen, spare_pids, wait_for

from reactor_dist import WorkerCrashed

pytestmark = pytest.mark.alone  # as test_ray.py, whose cluster fixture it uses (says why)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("rejoin", [False, True], ids=["every-rank", "rejoin"])
def test_the_remote_rank_killed_then_restart_serves_the_next_call(cluster, rejoin):  # noqa: F811
    from restart_workers import Reduces

    worker = ReducesAndRejoins if rejoin else Reduces
    hosts_before = set(live_hosts())
    runner = placed_runner(worker=worker, init_process_group=True, call_timeout=60,
                           start_timeout=120, shutdown_grace=1.0)
    try:
        runner.start()
        placed = Probe(runner).placed
        remote = placed[1]
        assert not remote["local"]
        pids = [pid for pid, _, _ in runner.generate(Pid())]
        os.kill(remote["pid"], signal.SIGKILL)
        with pytest.raises(WorkerCrashed, match=r"rank 1 .*SIGKILL"):
            runner.generate(5)
        runner.restart()
        again = Probe(runner).placed
        assert [p["node"] for p in again] == [p["node"] for p in placed]  # same bundles
        assert again[1]["pid"] != remote["pid"]
        after = runner.generate(Pid())
        assert after[1][0] == again[1]["pid"]
        if rejoin:  # rank 0 kept its process and its worker
            assert after[0] == (pids[0], 1, 1)
        else:
            assert after[0][0] != pids[0]
        assert tuple(runner.generate(5)) == fresh(2, 5)
        assert runner.restarts == 1 and runner.healthy
        every = [p[k] for p in placed + again for k in ("pid", "host_pid")]
    finally:
        runner.shutdown()
    assert wait_gone(every, timeout=10) == []
    assert nothing_reserved() and wait_full().get("CPU") == 4.0
    assert set(live_hosts()) <= hosts_before  # no RankHost actor of ours is left


@pytest.mark.timeout(300)
def test_a_spare_in_a_bundle_of_its_own_takes_rank_1s_then_rank_0s_place(cluster, tmp_path):  # noqa: F811
    """world_size 2 and one spare: three 1-CPU bundles on two 2-CPU nodes, so the group
    spans nodes (bus and spares' socket over TCP, CurveZMQ).  Rank 1 SIGKILLed: the
    spare takes its place (its one load(), rejoin() as rank 1), rank 0 keeps its model;
    the successor loads in the bundle rank 1 left.  Then rank 0 SIGKILLed: the successor
    becomes rank 0, whose node holds the new group's store."""
    hosts_before = set(live_hosts())
    runner = placed_runner(worker=SpareAware, spares=1, ray_strategy="PACK",
                           init_process_group=True, call_timeout=60, start_timeout=120,
                           shutdown_grace=1.0, load_kwargs={"state_dir": str(tmp_path)})
    every: list[int] = []
    try:
        runner.start()
        probe = Probe(runner)
        placed, [spare] = probe.placed, probe.placed_spares
        assert spare["ready"] and runner.spares_ready == 1
        assert not all(p["local"] for p in placed + [spare])  # two nodes: TCP in use
        assert spare_pids(tmp_path) == [spare["pid"]]
        pids = [pid for pid, _, _ in runner.generate(Pid())]
        every += pids + [spare["pid"]] + [p["host_pid"] for p in placed + [spare]]

        os.kill(placed[1]["pid"], signal.SIGKILL)
        assert wait_gone([placed[1]["pid"]], timeout=10) == []
        runner.restart()
        assert runner.generate(Pid()) == [(pids[0], 1, 1), (spare["pid"], 1, 1)]
        assert tuple(runner.generate(5)) == fresh(2, 5)
        # (LOCAL_RANK, the last, is its place among its node's bundles: Ray's choice)
        assert [r[:-1] for r in seen(tmp_path) if r[1] == spare["pid"]] == \
            [["load", spare["pid"], None, True, False, False, None],
             ["rejoin", spare["pid"], 1, False, False, True, "1"]]
        now = probe.placed
        assert [p["pid"] for p in now] == [pids[0], spare["pid"]]
        assert now[1]["node"] == spare["node"]  # it keeps its bundle
        assert runner.spare_takeovers == 1
        assert wait_for(lambda: runner.spares_ready == 1, timeout=120)
        [successor] = probe.placed_spares
        assert successor["node"] == placed[1]["node"]  # the bundle rank 1 left
        assert successor["host_pid"] == placed[1]["host_pid"]
        assert spare_pids(tmp_path) == [spare["pid"], successor["pid"]]
        every.append(successor["pid"])

        os.kill(pids[0], signal.SIGKILL)
        assert wait_gone([pids[0]], timeout=10) == []
        runner.restart()
        assert runner.generate(Pid()) == [(successor["pid"], 1, 1), (spare["pid"], 1, 2)]
        assert tuple(runner.generate(7)) == fresh(2, 7)
        assert probe.placed[0]["node"] == successor["node"]
        assert runner.spare_takeovers == 2 and runner.restarts == 2 and runner.healthy
        assert wait_for(lambda: runner.spares_ready == 1, timeout=120)
        every += [s["pid"] for s in probe.placed_spares]
        # No load() but the three spares' and the two first ranks'.
        assert sorted(r[1] for r in seen(tmp_path) if r[0] == "load") == \
            sorted(pids + [spare["pid"], successor["pid"]] + [probe.placed_spares[0]["pid"]])
    finally:
        runner.shutdown()
    assert wait_gone(every, timeout=10) == []
    assert nothing_reserved() and wait_full().get("CPU") == 4.0
    assert set(live_hosts()) <= hosts_before


@pytest.mark.timeout(300)
def test_a_stopped_spare_on_ray_is_ended_and_replaced_in_its_bundle(cluster, tmp_path, caplog):  # noqa: F811
    """A SIGSTOPped spare cannot read its commands (its full pipe would hold up every
    rank's): its host says so, it is ended, and its successor loads in the same bundle."""
    import logging

    runner = placed_runner(worker=SpareAware, spares=1, ray_strategy="PACK",
                           init_process_group=True, call_timeout=60, start_timeout=120,
                           shutdown_grace=1.0, load_kwargs={"state_dir": str(tmp_path)})
    with caplog.at_level(logging.WARNING, logger="reactor_dist"):
        try:
            runner.start()
            probe = Probe(runner)
            [spare] = probe.placed_spares
            os.kill(spare["pid"], signal.SIGSTOP)
            assert wait_for(lambda: [s["pid"] for s in probe.placed_spares if s["ready"]]
                            not in ([], [spare["pid"]]), timeout=120)
            [successor] = probe.placed_spares
            assert successor["host_pid"] == spare["host_pid"]  # the same bundle
            assert wait_gone([spare["pid"]], timeout=10) == []
            assert spare_pids(tmp_path) == [spare["pid"], successor["pid"]]
            assert tuple(runner.generate(5)) == fresh(2, 5)
        finally:
            runner.shutdown()
    assert f"spare 2 (pid {spare['pid']}) is stopped: it is ended" in caplog.text
    assert wait_gone([successor["pid"]], timeout=10) == []
    assert nothing_reserved() and wait_full().get("CPU") == 4.0
