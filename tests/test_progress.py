"""Load progress: each rank's phase and load()'s own reports reach the caller."""

from __future__ import annotations

import logging

from timing_workers import LoadsShards

from reactor_dist import DistributedRunner, DistributedWorker
from reactor_dist.wire.progress import Display
from reactor_dist.wire.protocol import Field, Kind


def progress_records(caplog):
    return [r for r in caplog.records if r.name == "reactor_dist" and hasattr(r, "phase")]


def test_load_progress_and_phases_reach_the_caller_as_log_records(caplog):
    caplog.set_level(logging.INFO, logger="reactor_dist")
    with DistributedRunner(LoadsShards, world_size=2, device="cpu",
                           load_kwargs={"shards": 4}) as runner:
        assert runner.generate(3) == 3
    records = progress_records(caplog)
    for rank in (0, 1):
        mine = [r for r in records if r.rank == rank]
        phases = [r.phase for r in mine if not hasattr(r, "done")]
        assert phases == ["importing", "forming the torch group", "loading"], phases
        last = [r for r in mine if getattr(r, "done", None) == 4]
        assert len(last) == 1 and last[0].total == 4 and last[0].unit == "shards"
        assert last[0].getMessage().startswith(f"rank {rank}: loading 4/4 shards (")
        assert last[0].getMessage().endswith(" s into start)")


def test_without_a_group_there_is_only_the_loading_phase(caplog):
    caplog.set_level(logging.INFO, logger="reactor_dist")
    with DistributedRunner(LoadsShards, world_size=2, device="cpu", init_process_group=False,
                           load_kwargs={"shards": 2, "pause": 0.0}):
        pass
    phases = {(r.rank, r.phase) for r in progress_records(caplog) if not hasattr(r, "done")}
    assert phases == {(0, "loading"), (1, "loading")}


def test_the_log_display_throttles_a_ranks_reports_but_keeps_the_last(caplog):
    caplog.set_level(logging.INFO, logger="reactor_dist")
    display = Display(1)
    for done in range(1, 101):
        display.update({Field.KIND: Kind.PROGRESS, Field.RANK: 0, Field.PHASE: "loading",
                        Field.DONE: float(done), Field.TOTAL: 100.0, Field.UNIT: "MB"})
    shown = [r.done for r in progress_records(caplog)]
    assert shown == [1.0, 100.0]


def test_report_progress_outside_a_rank_does_nothing():
    DistributedWorker().report_progress(1, 2, "shards")


class FakeBar:
    """The part of tqdm's interface the display uses (tqdm itself is an optional extra)."""

    made: list[FakeBar] = []

    def __init__(self, desc, position, leave, file):
        self.desc, self.position, self.total, self.unit, self.n = desc, position, None, "it", 0
        self.refreshed = self.closed = 0
        FakeBar.made.append(self)

    def set_description_str(self, desc, refresh=True):
        self.desc = desc

    def refresh(self):
        self.refreshed += 1

    def close(self):
        self.closed += 1


def test_in_a_terminal_with_tqdm_each_rank_gets_a_bar(monkeypatch, caplog):
    from reactor_dist.wire import progress

    caplog.set_level(logging.INFO, logger="reactor_dist")
    monkeypatch.setattr(progress, "tqdm_if_terminal", lambda: FakeBar)
    FakeBar.made.clear()
    display = Display(2)
    for rank in (0, 1):
        display.update({Field.KIND: Kind.PROGRESS, Field.RANK: rank, Field.PHASE: "importing"})
    display.update({Field.KIND: Kind.PROGRESS, Field.RANK: 1, Field.PHASE: "loading",
                    Field.DONE: 2.0, Field.TOTAL: 8.0, Field.UNIT: "shards"})
    zero, one = FakeBar.made
    assert (zero.position, zero.desc) == (0, "rank 0: importing")
    assert (one.desc, one.n, one.total, one.unit) == ("rank 1: loading", 2.0, 8.0, "shards")
    display.close()
    assert zero.closed == one.closed == 1
    assert progress_records(caplog) == []  # bars instead of log lines


def test_without_a_terminal_there_are_no_bars(monkeypatch):
    from reactor_dist.wire import progress

    monkeypatch.setattr(progress.sys.stderr, "isatty", lambda: False, raising=False)
    assert progress.tqdm_if_terminal() is None
