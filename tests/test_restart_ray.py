"""restart() with placement="ray", on test_ray's simulated two-node cluster: the remote
rank starts again through its RankHost, in its bundle, on its node."""

from __future__ import annotations

import os
import signal

import pytest
from conftest import wait_gone
from probe import Probe
from restart_workers import Pid, ReducesAndRejoins
from test_ray import cluster, live_hosts, nothing_reserved, placed_runner, wait_full  # noqa: F401
from test_restart import fresh

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
