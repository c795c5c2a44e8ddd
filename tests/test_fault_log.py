"""The log lines of a fault and of the restart after it (issue 46, item 4): one line
for the failure, one for the restart with one duration; a fault that ``retry_failed``
hid from the application (no caller got an error) is a WARNING that says what is sent
again, one that a caller got an ERROR.  Real ranks, a real SIGKILL or exit."""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest
from session_workers import Die, Rollout, reference
from timing_workers import DiesInCall

from reactor_dist import DistributedRunner, WorkerCrashed
from reactor_dist.caller.fault_log import headline, one_line

XS = [1.0, 2.0, 3.0, 4.0, 5.0]
# Another engineer's collective ring may put what the dead rank's collective was first.
COLLECTIVE = r"(?:rank 1 died before entering [^;]*(?:; [^;]*)?; )?"


def records(caplog, level=logging.WARNING) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "reactor_dist" and r.levelno >= level]


def test_a_fault_retry_failed_hid_is_one_warning_and_the_restart_one_line(caplog, tmp_path):
    caplog.set_level(logging.INFO, logger="reactor_dist")
    got = []
    with DistributedRunner(Rollout, world_size=2, device="cpu", snapshot_every=2,
                           max_restarts=1, retry_failed=True, shutdown_grace=1.0,
                           load_kwargs={"state_dir": None}, start_timeout=90) as runner:
        for x in XS:
            die = Die(x, 1, str(tmp_path / "marker")) if x == 4.0 else x
            got.append(runner.generate(die))
    for want, have in zip(reference(XS, 2), got, strict=True):
        np.testing.assert_array_equal(have, want)  # the application never saw the fault
    fault, restart = records(caplog)
    assert fault.levelno == logging.WARNING and restart.levelno == logging.WARNING
    assert re.fullmatch(
        COLLECTIVE + r"rank 1 died during generate\(\) \(call (\d+)\): rank 1 \(pid \d+\) killed "
        r"by SIGKILL \(the kernel OOM killer sends this too\); no output; the runner is "
        r"restarting \(restart 1 of max_restarts=1 within 600 s\): the next call waits for "
        r"it; retry_failed sends generate\(\) \(call \1\) again: no caller saw an error",
        fault.getMessage()), fault.getMessage()
    call = re.search(r"during generate\(\) \(call (\d+)\)", fault.getMessage()).group(1)
    assert re.fullmatch(
        r"restart 1 after WorkerCrashed \(rank 1 died [^)]*(?:\)[^)]*)?\) in \d+\.\d\d s: new "
        r"process and load\(\) for rank 0, 1; no rank kept its model; every rank restored "
        r"the snapshot and ran the 1 call since it again; generate\(\) \(call "
        + call + r"\) sent again \(retry_failed\)", restart.getMessage()), restart.getMessage()
    assert len(re.findall(r"\d s\b", restart.getMessage())) == 1  # one duration


def test_a_fault_a_caller_got_is_one_error_line(caplog):
    caplog.set_level(logging.INFO, logger="reactor_dist")
    with DistributedRunner(DiesInCall, world_size=2, device="cpu", init_process_group=False,
                           max_restarts=1, shutdown_grace=1.0) as runner:
        with pytest.raises(WorkerCrashed) as caught:
            runner.generate(1)
        runner.wait_idle(60)  # the restart ends
    fault, restart = records(caplog)
    assert fault.levelno == logging.ERROR
    assert "\n" in str(caught.value)  # the error keeps every line ...
    assert re.fullmatch(  # ... its record is one
        r"rank 1 died during generate\(\) \(call 1\): rank 1 \(pid \d+\) exited with code 3; "
        r"no output; the runner is restarting \(restart 1 of max_restarts=1 within 600 s\): "
        r"the next call waits for it", fault.getMessage()), fault.getMessage()
    assert re.fullmatch(r"restart 1 after WorkerCrashed \(rank 1 died during generate\(\) "
                        r"\(call 1\)\) in \d+\.\d\d s: new process and load\(\) for rank 0, 1; "
                        r"no rank kept its model", restart.getMessage()), restart.getMessage()


def test_one_line_keeps_each_dead_ranks_last_output_line():
    crash = WorkerCrashed("rank 0, 1 died during generate() (call 6): rank 0 (pid 11) exited "
                          "with code 3; last output:\n    loading\n    out of memory\nrank 1 "
                          "(pid 12) killed by SIGKILL; last output:\n    (no output)")
    assert one_line(crash) == (
        "rank 0, 1 died during generate() (call 6): rank 0 (pid 11) exited with code 3; last "
        "output line: 'out of memory'; rank 1 (pid 12) killed by SIGKILL; no output")
    assert headline(crash) == "WorkerCrashed (rank 0, 1 died during generate() (call 6))"
