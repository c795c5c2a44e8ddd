"""The asyncio API with real ranks: the loop never stalls, tasks take turns in the order
they called, a cancelled call leaves the runner healthy, and the sync contract holds."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest
from probe import Probe
from sample_workers import FAULT, Echo, ExitsOnRank, Raises, Sleep
from stream_workers import Counts, RaisesAfter, Slow

from reactor_dist import RankDesync, WorkerCrashed, WorkerTimeout


async def ticking(during) -> list[float]:
    """The gaps between the ticks of a 5 ms ticker while ``during`` is awaited."""
    ticks: list[float] = []

    async def ticker() -> None:
        while True:
            ticks.append(time.monotonic())
            await asyncio.sleep(0.005)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.02)
    try:
        await during
    finally:
        task.cancel()
    return [b - a for a, b in zip(ticks, ticks[1:], strict=False)]


@pytest.mark.alone  # how long the loop stalls is what it measures: not beside other tests
def test_the_loop_keeps_ticking_during_a_half_second_call(runner_for):
    async def main():
        async with runner_for(Echo) as runner:
            gaps = await ticking(runner.agenerate(Sleep(0.5, "slept")))
            assert await runner.agenerate("next") == "next"
            return gaps

    gaps = asyncio.run(main())
    # wall-clock: ~100 ticks of 5 ms in the 0.5 s call on an idle machine; 30 is over 3x
    # under that, and a loop stalled by the call would tick 4 times (the 20 ms before it)
    assert len(gaps) >= 30, f"{len(gaps)} ticks"
    # wall-clock: a gap is 5-7 ms on an idle machine; a stalled loop's is the whole call
    # (0.5 s): 0.25 s is 35x the one and half the other
    assert max(gaps) < 0.25, f"the loop stalled for {max(gaps) * 1000:.0f} ms"


def test_tasks_take_turns_in_the_order_they_called(runner_for):
    async def main():
        async with runner_for(Echo) as runner:
            order: list[int] = []

            async def one(i: int):
                value = await runner.agenerate(Sleep(0.05, i))
                order.append(value)
                return value

            results = await asyncio.gather(*(one(i) for i in range(5)))
            return results, order

    results, order = asyncio.run(main())
    assert results == [0, 1, 2, 3, 4] and order == [0, 1, 2, 3, 4]


def test_a_cancelled_call_raises_at_once_and_the_next_call_gets_its_own_result(runner_for):
    async def main():
        async with runner_for(Echo) as runner:
            task = asyncio.create_task(runner.agenerate(Sleep(0.6, "late")))
            await asyncio.sleep(0.1)
            started = time.monotonic()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # wall-clock: under 1 ms on an idle machine; waiting for the call instead would
            # take the 0.5 s its ranks have left
            assert time.monotonic() - started < 0.1
            assert runner.healthy
            assert await runner.agenerate("own") == "own"
            assert runner.generate("sync too") == "sync too"
            assert runner.healthy

    asyncio.run(main())


def test_areset_astream_and_the_error_contract(runner_for):
    async def main():
        async with runner_for(RaisesAfter) as runner:
            got = []
            with pytest.raises(ValueError, match="bad item on rank 0"):
                async for item in runner.astream({"after": 2, "errors": ["value", "value"]}):
                    got.append(item)
            assert got == [0, 1] and runner.healthy
            await runner.areset()
            assert await runner.agenerate({"after": 2, "errors": [None, None]}) == [0, 1]
            with pytest.raises(RankDesync):
                await runner.agenerate({"after": 1, "errors": [None, "key"]})
            assert not runner.healthy
            with pytest.raises(RuntimeError, match="unusable"):
                await runner.agenerate({"after": 1, "errors": [None, None]})

    asyncio.run(main())


def test_same_exception_everywhere_via_agenerate_keeps_the_runner_healthy(runner_for):
    async def main():
        async with runner_for(Raises, load_kwargs={"error": ValueError}) as runner:
            with pytest.raises(ValueError, match="boom on rank 0"):
                await runner.agenerate(FAULT)
            assert runner.healthy
            assert await runner.agenerate(3) == 3

    asyncio.run(main())


def test_astream_leaving_early_and_the_next_call(runner_for):
    async def main():
        async with runner_for(Counts) as runner:
            async for item in runner.astream(6):
                assert item == {"i": 0, "rank": 0}
                break
            assert await runner.agenerate(2) == [{"i": 0, "rank": 0}, {"i": 1, "rank": 0}]
            stream = runner.astream(3)
            assert await stream.__anext__() == {"i": 0, "rank": 0}
            await stream.aclose()
            assert [i async for i in runner.astream(1)] == [{"i": 0, "rank": 0}]
            assert runner.healthy

    asyncio.run(main())


def test_a_timeout_and_a_crash_reach_the_awaiting_task(runner_for):
    async def main():
        async with runner_for(Slow) as runner:
            with pytest.raises(WorkerTimeout, match="no answer from rank 1 within 0.3 s"):
                async for _ in runner.astream({"n": 3, "hang_after": 1, "hang_rank": 1},
                                              timeout=0.3):
                    pass
            assert not runner.healthy
        async with runner_for(ExitsOnRank, load_kwargs={"rank": 1}) as runner:
            started = time.monotonic()
            with pytest.raises(WorkerCrashed, match="rank 1 died"):
                await runner.agenerate(FAULT)
            # wall-clock: about 6 ms on an idle machine (the documented bound: within 1 s of
            # the death); missing the death would be the 20 s call_timeout
            assert time.monotonic() - started < 1.0

    asyncio.run(main())


def test_astream_is_for_async_for_only(runner_for):
    async def main():
        async with runner_for(Counts) as runner:
            with pytest.raises(TypeError, match="iterated with `async for`"):
                for _ in runner.astream(1):
                    pass
            with pytest.raises(TypeError, match="is not awaited"):
                await runner.astream(1)
            assert await runner.agenerate(1) == [{"i": 0, "rank": 0}]

    asyncio.run(main())


def test_a_sync_call_from_another_thread_waits_for_the_async_one(runner_for):
    async def main():
        async with runner_for(Echo) as runner:
            done = []
            task = asyncio.create_task(runner.agenerate(Sleep(0.4, "async")))
            await asyncio.sleep(0.1)
            thread = threading.Thread(target=lambda: done.append(runner.generate("sync")))
            thread.start()
            assert await task == "async"
            await asyncio.to_thread(thread.join, 10)
            assert done == ["sync"]

    asyncio.run(main())


def test_one_runner_across_two_event_loops(runner_for):
    runner = runner_for(Echo)
    runner.start()
    try:
        assert asyncio.run(runner.agenerate(1)) == 1
        assert asyncio.run(runner.agenerate(2)) == 2
    finally:
        asyncio.run(runner.ashutdown())
    assert not runner.healthy



@pytest.mark.parametrize("ending", ["shutdown() in the task", "await ashutdown()"])
def test_a_loop_watches_nothing_of_a_runner_shut_down(runner_for, ending):
    """A task's loop keeps its reader on the reply socket from one call to the next;
    shutdown takes it away before the socket closes, whichever thread shuts down.  A
    reader left on a closed descriptor would swallow the next file the loop watches
    under that number."""
    async def main():
        loop = asyncio.get_running_loop()
        runner = runner_for(Echo)
        await runner.astart()
        descriptor = Probe(runner).reply_descriptor
        assert [await runner.agenerate(i) for i in range(3)] == [0, 1, 2]
        if ending == "await ashutdown()":
            await runner.ashutdown()
        else:
            runner.shutdown()  # right after the call: before the loop's next turn
        return loop.remove_reader(descriptor)  # True: a reader was still there

    assert asyncio.run(main()) is False


def test_a_loop_no_task_waits_in_does_not_spin_on_a_message_nobody_reads(runner_for):
    """A rank's death while nobody calls leaves its notice unread on the reply socket,
    whose descriptor then stays readable.  The loop of a task that awaited a call before
    drops its reader when it first fires with no task waiting, rather than spin on it;
    the next call still reports the death."""
    runner = runner_for(Echo)
    runner.start()

    async def main() -> float:
        assert await runner.agenerate(1) == 1  # the loop keeps its reader after the call
        os.kill(Probe(runner).rank_pids[1], signal.SIGKILL)
        began = time.thread_time()  # this thread's CPU: a loop that spins burns it
        await asyncio.sleep(1.0)
        return time.thread_time() - began

    spent = asyncio.run(main())
    # A spinning loop spends most of the second on CPU (load only takes CPU from it);
    # an idle one, milliseconds.
    assert spent < 0.3, f"the loop spent {spent:.2f} s of CPU while no task waited"
    with pytest.raises(WorkerCrashed):
        runner.generate(2)
