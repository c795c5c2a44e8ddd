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
from reactor_dist.placement.output import RankOutput


def runner(**options) -> DistributedRunner:
    return DistributedRunner(Echo, world_size=2, device="cpu", init_process_group=False,
                             call_timeout=0.5, **options)


def stop(pid: int) -> None:
    os.kill(pid, signal.SIGSTOP)
    wait_for(lambda: psutil.Process(pid).status() == psutil.STATUS_STOPPED)


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        # wall-clock: met in ms on an idle machine (a SIGSTOP taking effect); 10 s is a
        # hang's bound, not a speed's
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


def forwarded(lines: list[str], capfd) -> list[str]:
    """What a rank's output pump that owes a late dump prints of ``lines`` (a real pipe)."""
    read, write = os.pipe()
    output = RankOutput(1, read)
    output.late_dump_owed = True
    os.write(write, "".join(f"{line}\n" for line in lines).encode())
    os.close(write)
    output.join(timeout=10)
    os.close(read)
    return capfd.readouterr().err.splitlines()


LATE_DUMP = ["Thread 0x00007f0000000001 (most recent call first):",
             '  File "late.py", line 1 in wait', "",
             "Current thread 0x00007f0000000002 (most recent call first):",
             '  File "late.py", line 2 in run']
CRASH = ["Fatal Python error: Segmentation fault", "",
         "Current thread 0x00007f0000000003 (most recent call first):",
         '  File "crash.py", line 3 in run']


def test_an_owed_dump_is_dropped_up_to_its_end_and_a_crash_dump_is_still_shown(capfd):
    assert forwarded(["before", *LATE_DUMP, "after"], capfd) == [
        "[rank 1] before", "[rank 1] after"]
    assert forwarded(["before", *CRASH], capfd) == [
        "[rank 1] before", *(f"[rank 1] {line}" for line in CRASH)]
