"""The library's own messages on the ``reactor_dist`` logger; rank output as log records."""

from __future__ import annotations

import logging

import pytest
from timing_workers import DiesInCall, Talks

from reactor_dist import DistributedRunner, WorkerCrashed


def ours(caplog, level=logging.INFO):
    return [r for r in caplog.records if r.name == "reactor_dist" and r.levelno >= level]


def test_start_each_load_and_shutdown_are_logged(caplog, runner_for):
    caplog.set_level(logging.INFO, logger="reactor_dist")
    with runner_for(Talks, load_kwargs={"pause": 0.1}) as runner:
        runner.generate(1)
    messages = [r.getMessage() for r in ours(caplog)]
    assert any(m.startswith("started 2 ranks (pids ") for m in messages), messages
    loads = [r for r in ours(caplog) if "load() done" in r.getMessage()]
    assert sorted(r.rank for r in loads) == [0, 1]
    for record in loads:
        assert record.load_seconds >= 0.1  # wall-clock: a lower bound: load() sleeps 0.1 s
        assert record.getMessage().startswith(f"rank {record.rank}: load() done in ")
        assert record.getMessage().endswith(" s on cpu")
    assert any(m.startswith("shut down 2 ranks (gracefully)") for m in messages), messages


def test_forming_the_group_is_logged(caplog, runner_for):
    caplog.set_level(logging.INFO, logger="reactor_dist")
    with runner_for(Talks, init_process_group=True):
        pass
    assert any(r.getMessage().startswith("torch group formed (2 ranks) in ")
               for r in ours(caplog))


def test_a_crash_report_is_logged_as_an_error(caplog, runner_for):
    caplog.set_level(logging.INFO, logger="reactor_dist")
    with runner_for(DiesInCall) as runner, pytest.raises(WorkerCrashed) as caught:
        runner.generate(1)
    (record,) = ours(caplog, logging.ERROR)
    assert record.getMessage() == str(caught.value)
    assert "rank 1" in record.getMessage() and "exited with code 3" in record.getMessage()


def test_rank_output_goes_to_stderr_by_default(caplog, capfd, runner_for):
    caplog.set_level(logging.INFO)
    with runner_for(Talks) as runner:
        runner.generate(5)
    err = capfd.readouterr().err
    assert "[rank 0] loaded rank 0" in err and "[rank 1] rank 1 got 5" in err
    assert not [r for r in caplog.records if r.name == "reactor_dist.rank"]


def test_rank_output_as_log_records(caplog, capfd, runner_for):
    caplog.set_level(logging.INFO, logger="reactor_dist.rank")
    with runner_for(Talks, rank_output="log") as runner:
        runner.generate(5)
    assert "loaded rank" not in capfd.readouterr().err
    lines = {(r.rank, r.getMessage()) for r in caplog.records if r.name == "reactor_dist.rank"}
    assert (0, "[rank 0] loaded rank 0") in lines and (1, "[rank 1] rank 1 got 5") in lines


def test_rank_output_is_checked():
    with pytest.raises(ValueError, match="rank_output"):
        DistributedRunner(Talks, rank_output="file")
