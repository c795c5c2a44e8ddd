"""A rank's log records of a call reach the caller's logging before the call returns
(issue 46, item 3): before its result, its error and its stream's end, at world_size 2
and 4, in many calls in a row.  The records travel each rank's output pipe, the reply
the bus: the caller takes in what the pipes hold as the last reply arrives."""

from __future__ import annotations

import logging

import pytest
from record_workers import LogsInEveryCall

CALLS = 150


class Kept(logging.Handler):
    """The (call number, rank) of each record, as it is handled."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[tuple[int, int]] = set()

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.add((int(record.getMessage().split()[1]), record.rank))


@pytest.fixture
def kept():
    logger = logging.getLogger("model.calls")
    handler = Kept()
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_record_of_a_call_is_in_before_it_returns(kept, runner_for, world_size):
    ranks = set(range(world_size))
    late = []
    with runner_for(LogsInEveryCall, world_size=world_size, call_timeout=60,
                    start_timeout=120) as runner:
        for n in range(CALLS):
            kind = ("ok", "raise", "stream")[n % 3]
            if kind == "ok":
                assert runner.generate(("ok", n)) == n
            elif kind == "raise":
                with pytest.raises(ValueError, match=f"^call {n}$"):
                    runner.generate(("raise", n))
            else:
                assert list(runner.stream(("stream", n))) == [0, 1, 2]
            got = {rank for call, rank in kept.seen if call == n}
            if got != ranks:
                late.append((n, kind, sorted(ranks - got)))
    assert late == []
    assert len(kept.seen) == CALLS * world_size
