"""The error contract's policy, without a process: every row of ``outcome.judge``.

The same rows are proven end to end, with real ranks, in test_error_contract.py
and test_faults.py; here each is pinned down exactly and in isolation.
"""

from __future__ import annotations

import pytest

from reactor_dist import RankDesync, RankFailure
from reactor_dist.caller.outcome import RETURNED, Outcome, judge
from reactor_dist.wire.protocol import Status


def raised(exc: BaseException, failure: RankFailure | None = None) -> Outcome:
    return Outcome(Status.RAISED, None, exc, type(exc).__name__, failure)


def test_every_rank_returned_gives_rank_0s_value():
    verdict = judge("generate", [Outcome(Status.OK, "frames"), RETURNED, RETURNED])
    assert verdict == ("frames", None, False)


def test_reset_returns_none():
    assert judge("reset", [RETURNED, RETURNED]) == (None, None, False)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_every_rank_raised_the_same_type_gives_rank_0s_exception(world_size):
    errors = [ValueError(f"bad on {r}") for r in range(world_size)]
    verdict = judge("generate", [raised(e) for e in errors])
    assert verdict.error is errors[0] and verdict.breaks is False and verdict.value is None


def test_same_type_is_judged_by_the_ranks_type_name_not_the_rebuilt_class():
    # An exception that did not pickle arrives as RemoteError; its rank's type name counts.
    outcomes = [Outcome(Status.RAISED, None, RuntimeError("stand-in"), "mod.Unpicklable"),
                Outcome(Status.RAISED, None, RuntimeError("stand-in"), "mod.Unpicklable")]
    verdict = judge("generate", outcomes)
    assert verdict.error is outcomes[0].error and verdict.breaks is False


def test_different_types_are_a_desync_naming_each_rank():
    first, second = ValueError("a"), KeyError("b")
    verdict = judge("generate", [raised(first), raised(second)])
    assert isinstance(verdict.error, RankDesync) and verdict.breaks is True
    assert str(verdict.error) == ("ranks raised different exception types in generate(): "
                                  "rank 0 raised ValueError, rank 1 raised KeyError; the runner "
                                  "is unusable: runner.restart() brings its ranks back "
                                  "(DistributedRunner(max_restarts=N) restarts it by itself)")
    assert verdict.error.__cause__ is first
    assert verdict.error.rank_errors == {0: first, 1: second}


def test_some_raised_others_returned_is_a_desync_naming_the_first_failing_rank():
    error = ValueError("only here")
    verdict = judge("reset", [RETURNED, raised(error), RETURNED, raised(KeyError("x"))])
    assert isinstance(verdict.error, RankDesync) and verdict.breaks is True
    assert str(verdict.error) == ("rank 1 raised ValueError in reset() while rank 0, 2 "
                                  "returned: the ranks are out of step; the runner is unusable: "
                                  "runner.restart() brings its ranks back "
                                  "(DistributedRunner(max_restarts=N) restarts it by itself)")
    assert verdict.error.__cause__ is error
    assert set(verdict.error.rank_errors) == {1, 3}


def test_a_desync_carries_the_records_of_the_ranks_that_raised_in_rank_order():
    def record(rank: int, error: BaseException) -> RankFailure:
        return RankFailure(rank, 100 + rank, "node", "cpu", True, error=error, call_seq=7,
                           method="generate")

    one, three = ValueError("only here"), KeyError("x")
    outcomes = [RETURNED, raised(one, record(1, one)), RETURNED,
                raised(three, record(3, three))]
    verdict = judge("generate", outcomes)
    assert verdict.error.failures == (record(1, one), record(3, three))
    assert [f.error for f in verdict.error.failures] == [one, three]


def test_undeliverable_result_alone_keeps_the_runner_healthy():
    error = MemoryError("/dev/shm is full")
    undeliverable = Outcome(Status.UNDELIVERABLE, None, error, "MemoryError")
    verdict = judge("generate", [undeliverable, RETURNED])
    assert verdict == (None, error, False)


def test_undeliverable_result_beside_the_same_exception_elsewhere_is_that_exception():
    mine, theirs = TypeError("cannot pickle"), TypeError("raised")
    verdict = judge("generate", [Outcome(Status.UNDELIVERABLE, None, mine, "TypeError"),
                                 raised(theirs)])
    assert verdict.error is mine and verdict.breaks is False


def test_undeliverable_result_beside_another_type_is_a_desync():
    mine, theirs = TypeError("cannot pickle"), ValueError("raised")
    verdict = judge("generate", [Outcome(Status.UNDELIVERABLE, None, mine, "TypeError"),
                                 raised(theirs)])
    assert isinstance(verdict.error, RankDesync) and verdict.breaks is True
    assert "rank 0 raised TypeError, rank 1 raised ValueError" in str(verdict.error)
    assert verdict.error.__cause__ is mine


def test_undeliverable_result_beside_a_raise_and_a_return_is_a_desync():
    mine = TypeError("cannot pickle")
    verdict = judge("generate", [Outcome(Status.UNDELIVERABLE, None, mine, "TypeError"),
                                 raised(TypeError("x")), RETURNED])
    assert isinstance(verdict.error, RankDesync) and verdict.breaks is True
    assert str(verdict.error).startswith("rank 0 raised TypeError in generate() while rank 2 "
                                         "returned")
