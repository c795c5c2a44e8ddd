"""A result that was returned is never wrong, with calls in flight (issue 30, item 0).

A rank that raised in a call may have left collectives its peers are still inside. If
it went on to the call queued behind (``max_in_flight=2`` sends it at once), that
call's ``all_reduce`` would pair with a peer's ``all_reduce`` of the old call, and the
peer would hand out the mixed value as a good item or result. Each rank that raised
therefore holds the next call until every rank answered the one it raised in
(Kind.ANSWERED) or a restart dropped it: the peers stay in their collective, the call
the ranks run times out (naming the rank that raised), and the call behind fails
behind it. Without the hold, the stream below yields ``[1002.0, ...]`` (its own item 2
plus the queued call's 1000) where ``[2.0, 5.0, ...]`` is right.

Each form of call (``stream``, ``generate``, ``submit``, ``agenerate``) at world_size
2 and 3; the worker is ``restart_workers.Reduces``: every item and result is an
``all_reduce`` of ``arange(4) * (rank + 1) + x``.
"""

from __future__ import annotations

import asyncio
import re

import pytest
from pipeline_workers import NapOn, NapThenExit
from restart_workers import FaultAt, Reduces

from reactor_dist import DistributedRunner, WorkerCrashed, WorkerTimeout

BEHIND = 1000.0  # the input of the call queued behind the faulty one


def reduced(x: float, world_size: int) -> list[float]:
    return [float(sum(i * (r + 1) + x for r in range(world_size))) for i in range(4)]


def runner_of(world_size: int) -> DistributedRunner:
    return DistributedRunner(Reduces, world_size=world_size, device="cpu", call_timeout=2.0)


def silent_of(world_size: int) -> str:
    """The ranks left waiting in the collective that rank 1 never entered."""
    return ", ".join(str(r) for r in range(world_size) if r != 1)


def waiting(world_size: int) -> str:
    """What the collective rings say of the ranks left waiting (collective_ring)."""
    return "rank 0 waits in it" if world_size == 2 else "ranks 0 and 2 wait in it"


def check_timeout_names_the_call_the_ranks_ran(exc: BaseException, world_size: int) -> None:
    assert type(exc) is WorkerTimeout, repr(exc)
    first, second = str(exc).splitlines()[:2]
    assert re.fullmatch(rf"rank 1 raised InjectedFault before all_reduce #\d of call 1; "
                        rf"{waiting(world_size)}", first), first
    assert second.startswith(f"no answer from rank {silent_of(world_size)} within 2 s during "
                             f"generate() (call 1) (rank 1 raised "
                             f"sample_workers.InjectedFault:"), second


def check_behind(exc: BaseException, world_size: int) -> None:
    assert type(exc) is WorkerTimeout, repr(exc)
    assert re.fullmatch(rf"generate\(\) \(call 2\) did not run to its end: the runner broke "
                        rf"at generate\(\) \(call 1\): rank 1 raised InjectedFault before "
                        rf"all_reduce #\d of call 1; {waiting(world_size)}", str(exc)), str(exc)


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_stream_never_hands_out_an_item_mixed_with_the_call_behind_it(world_size):
    with runner_of(world_size) as runner:
        stream = runner.stream(FaultAt("desync", 1, "stream"))  # rank 1 raises at item 2
        behind = runner.submit(BEHIND)
        items = []
        with pytest.raises(WorkerTimeout) as info:
            for item in stream:
                items.append(item)
        assert items == [reduced(0, world_size), reduced(1, world_size)]
        check_timeout_names_the_call_the_ranks_ran(info.value, world_size)
        with pytest.raises(WorkerTimeout) as behind_info:
            behind.result(timeout=30)
        check_behind(behind_info.value, world_size)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("form", ["generate", "submit"])
def test_a_call_whose_rank_raised_before_a_collective_never_pairs_with_the_next(form,
                                                                             world_size):
    with runner_of(world_size) as runner:
        first = runner.submit(FaultAt("desync", 1, "collective"))
        if form == "generate":
            with pytest.raises(WorkerTimeout) as behind_info:
                runner.generate(BEHIND)
        else:
            with pytest.raises(WorkerTimeout) as behind_info:
                runner.submit(BEHIND).result(timeout=30)
        check_behind(behind_info.value, world_size)
        with pytest.raises(WorkerTimeout) as info:
            first.result(timeout=30)
        check_timeout_names_the_call_the_ranks_ran(info.value, world_size)


@pytest.mark.parametrize("world_size", [2, 3])
def test_asyncio_tasks_never_get_a_result_mixed_with_another_call(world_size):
    async def main(runner):
        first = asyncio.create_task(runner.agenerate(FaultAt("desync", 1, "collective")))
        await asyncio.sleep(0)  # the first task sends first
        behind = asyncio.create_task(runner.agenerate(BEHIND))
        return await asyncio.gather(first, behind, return_exceptions=True)

    with runner_of(world_size) as runner:
        first, behind = asyncio.run(main(runner))
    check_timeout_names_the_call_the_ranks_ran(first, world_size)
    check_behind(behind, world_size)


@pytest.mark.parametrize("world_size", [2, 3])
def test_after_every_rank_raised_the_held_call_runs_and_returns_its_own_result(world_size):
    """Every rank raised the same type: the call fails alone, the ranks are told it is
    over and run the call behind it, which returns exactly its own result."""
    with runner_of(world_size) as runner:
        failing = runner.submit(FaultAt("raise_all", -1, "call"))
        behind = runner.submit(BEHIND)
        with pytest.raises(ValueError, match="every rank raises"):
            failing.result(timeout=30)
        assert behind.result(timeout=30) == reduced(BEHIND, world_size)
        assert runner.generate(3.0) == reduced(3.0, world_size) and runner.healthy


def test_a_death_names_the_call_the_dead_rank_ran_not_the_one_in_front():
    """Rank 1 answered call 1 and died in call 2 while rank 0 still ran call 1: the
    crash is call 2's, and call 1 says that call 2 broke the runner."""
    with runner_of(2) as runner:
        first = runner.submit(NapOn(0, 1.0, "first"))
        second = runner.submit(NapThenExit(1, 0.3))  # dies while rank 0 naps in call 1
        with pytest.raises(WorkerCrashed) as info:
            second.result(timeout=30)
        assert str(info.value).startswith("rank 1 died during generate() (call 2): "), \
            str(info.value)
        with pytest.raises(WorkerCrashed) as first_info:
            first.result(timeout=30)
        assert str(first_info.value).startswith(
            "generate() (call 1) did not run to its end: the runner broke at generate() "
            "(call 2): rank 1 died"), str(first_info.value)


def test_a_rank_that_dies_the_moment_it_begins_a_call_is_named_in_that_call():
    """Rank 1 answers call 1 and leaves the moment it begins call 2: its reply to call
    1 may still be on its way behind the death's notice, or lost with it.  Its ring says
    it began call 2, so the crash is call 2's either way; call 1 has its result, or
    (its reply lost) says that call 2 broke the runner.  Three rounds, restarts between."""
    with runner_of(2) as runner:
        calls = 0
        for _ in range(3):
            first = runner.submit(NapOn(0, 0.0, "first"))
            second = runner.submit(NapThenExit(1, 0.0))
            with pytest.raises(WorkerCrashed) as info:
                second.result(timeout=30)
            died = re.match(r"rank 1 died during generate\(\) \(call (\d+)\): ", str(info.value))
            assert died, str(info.value)
            seq = int(died[1])
            assert seq == calls + 2, str(info.value)  # the second call of this round
            try:
                assert first.result(timeout=30) == "first"
            except WorkerCrashed as exc:
                assert str(exc).startswith(
                    f"generate() (call {seq - 1}) did not run to its end: the runner broke at "
                    f"generate() (call {seq}): rank 1 died"), str(exc)
            runner.restart()
            calls = seq
        assert runner.generate(3.0) == reduced(3.0, 2)
