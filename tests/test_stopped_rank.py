"""A stopped rank (issue 19): a timeout names it as stopped and says how to resume it,
stacks that come after the timeout was reported are not printed, and shutdown ends a
stopped rank without waiting out a grace period."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
from probe import Probe
from sample_workers import Echo, LateStacks, Say

from reactor_dist import DistributedRunner, WorkerTimeout


def runner(**options) -> DistributedRunner:
    return DistributedRunner(Echo, world_size=2, device="cpu", init_process_group=False,
                             call_timeout=0.5, **options)


def stop(pid: int) -> None:
    os.kill(pid, signal.SIGSTOP)
    wait_for(lambda: psutil.Process(pid).status() == psutil.STATUS_STOPPED)


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_a_stopped_rank_is_named_stopped_and_its_resumption_prints_no_stacks(capfd):
    with runner() as r:
        probe = Probe(r)
        pid = probe.rank_pids[1]
        stop(pid)
        with pytest.raises(WorkerTimeout, match="no answer from rank 1 within 0.5 s") as info:
            r.generate(Say("resumed"))
        message = str(info.value)
        assert (f"rank 1 (pid {pid}) is stopped (state T, by SIGSTOP), so it cannot answer "
                f"nor show its stacks: resume it with kill -CONT {pid}") in message, message
        capfd.readouterr()
        os.kill(pid, signal.SIGCONT)
        # It runs the call it was sent once resumed: by the time its line came through,
        # so had any stacks it wrote on resuming.
        wait_for(lambda: "resumed from rank 1" in probe.output_lines(1))
    err = capfd.readouterr().err
    assert "most recent call first" not in err, err
    assert "[rank 1] resumed from rank 1" in err  # its own lines are still forwarded


def test_stacks_that_come_after_the_timeout_are_not_printed(tmp_path, capfd):
    flag = tmp_path / "write-your-stacks"
    with runner() as r:
        probe = Probe(r)
        with pytest.raises(WorkerTimeout) as info:
            r.generate(LateStacks(rank=1, flag=str(flag)))
        assert f"rank 1 (pid {probe.rank_pids[1]}) wrote no stacks within 0.5 s of SIGUSR1" \
            in str(info.value), str(info.value)
        capfd.readouterr()
        flag.touch()
        wait_for(lambda: "stacks written late" in probe.output_lines(1))
        assert any("most recent call first" in line for line in probe.output_lines(1))
    err = capfd.readouterr().err
    assert "most recent call first" not in err and ' line ' not in err, err
    assert "[rank 1] stacks written late" in err  # the first line past the dump is shown


@pytest.mark.parametrize("state", ["healthy", "unusable"])
def test_shutdown_ends_a_stopped_rank_without_waiting_out_a_grace(state, caplog):
    caplog.set_level("INFO", logger="reactor_dist")
    r = runner(shutdown_grace=10)
    r.start()
    procs = Probe(r).rank_processes
    stop(procs[1].pid)
    if state == "unusable":
        with pytest.raises(WorkerTimeout):
            r.generate(1)
    r.shutdown()
    # Continued right after its SIGTERM, it acted on it: it was not left stopped until
    # the SIGKILL that follows a grace period.
    assert procs[1].popen.returncode == -signal.SIGTERM
    assert procs[0].popen.returncode == (0 if state == "healthy" else -signal.SIGTERM)
    if state == "healthy":
        assert f"rank 1 (pid {procs[1].pid}) is stopped: ending it without grace" \
            in caplog.text
