"""The library's own messages on the ``reactor_dist`` logger; rank output as log records."""

from __future__ import annotations

import logging

import pytest
from timing_workers import DiesInCall, Talks

from reactor_dist import DistributedRunner, WorkerCrashed
from reactor_dist.caller.fault_log import one_line


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
    assert record.getMessage() == one_line(caught.value)  # the error's text on one line
    assert "\n" in str(caught.value) and "\n" not in record.getMessage()
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


class JsonLines(logging.Handler):
    """The application's own handler: each record as one JSON line (kept here)."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []
        self.setFormatter(JsonFormatter())

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        import json

        return json.dumps({"name": record.name, "level": record.levelname,
                           "message": record.getMessage(), "rank": getattr(record, "rank", None),
                           "pid": getattr(record, "pid", None), "exc_text": record.exc_text,
                           "frame": getattr(record, "frame", None),
                           "tags": getattr(record, "tags", None)})


def test_a_ranks_log_records_reach_the_applications_handlers_as_records(capfd, runner_for):
    import json
    import time

    from probe import Probe
    from record_workers import LogsRecords

    model, noisy = logging.getLogger("model"), logging.getLogger("model.noisy")
    handler = JsonLines()
    model.addHandler(handler)
    model.setLevel(logging.INFO)
    noisy.setLevel(logging.ERROR)
    try:
        with runner_for(LogsRecords) as runner:
            pids = Probe(runner).rank_pids
            assert runner.generate(3) == 3
            deadline = time.monotonic() + 20  # the records come through each rank's pipe
            while len(handler.lines) < 6 and time.monotonic() < deadline:
                time.sleep(0.02)
            tails = [Probe(runner).output_lines(rank) for rank in (0, 1)]
        got = sorted((json.loads(line) for line in handler.lines),
                     key=lambda r: (r["rank"], r["message"]))
    finally:
        model.removeHandler(handler)
        model.setLevel(logging.NOTSET)
        noisy.setLevel(logging.NOTSET)
    assert [(r["rank"], r["level"], r["message"]) for r in got] == [
        (0, "INFO", "loaded on rank 0"), (0, "INFO", "step 3"), (0, "ERROR", "step 3 failed"),
        (1, "INFO", "loaded on rank 1"), (1, "INFO", "step 3"), (1, "ERROR", "step 3 failed")]
    assert {r["name"] for r in got} == {"model"}
    assert [r["pid"] for r in got] == [pids[0]] * 3 + [pids[1]] * 3
    steps = [r for r in got if r["message"] == "step 3"]
    assert [(r["frame"], r["tags"]) for r in steps] == [(6, ["a", "b"])] * 2  # extra fields
    for failed in (r for r in got if r["level"] == "ERROR"):
        assert failed["exc_text"].startswith("Traceback (most recent call last):")
        assert failed["exc_text"].endswith("ValueError: bad frame")
    for tail in tails:  # below the levels the application set: never sent
        assert not any("debug 3" in line or "noisy 3" in line for line in tail), tail
        assert "INFO:model:step 3" in tail
    err = capfd.readouterr().err
    assert "[rank 0] plain line" in err and "[rank 1] plain line" in err
    assert "step 3" not in err  # a record, not a line
