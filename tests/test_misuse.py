"""What a newcomer met (issue 23), with real ranks: one stream read by two threads or
two tasks, ``async for`` over ``stream()``, ``areset()``/``ashutdown()`` never awaited.
Each misuse gets an error or warning that says what to do, and costs nothing: no item
lost, nothing left in flight, the runner healthy."""

from __future__ import annotations

import asyncio
import gc
import inspect
import re
import threading
import warnings

import pytest
from conftest import our_shm_entries
from stream_workers import Counts, Frames, WaitsForTheCaller

from reactor_dist import DistributedRunner


def items(n: int) -> list[dict]:
    return [{"i": i, "rank": 0} for i in range(n)]


@pytest.fixture
def counts():
    with DistributedRunner(Counts, world_size=2, init_process_group=False, device="cpu",
                           call_timeout=20.0) as runner:
        yield runner


def in_thread(name: str, fn):
    """Run ``fn`` in a thread called ``name``: what it returned or raised."""
    out: list = []

    def run() -> None:
        try:
            out.append(("returned", fn()))
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            out.append(("raised", exc))

    thread = threading.Thread(target=run, name=name)
    thread.start()
    thread.join(10)
    assert not thread.is_alive()
    return out[0]


# -- one stream, two threads -------------------------------------------------------------------
def test_a_second_thread_is_refused_and_the_owner_gets_every_item_in_order(counts):
    stream = counts.stream(5)
    assert next(stream) == {"i": 0, "rank": 0}  # MainThread owns it now
    how, error = in_thread("reader-2", lambda: next(stream))
    assert how == "raised" and type(error) is RuntimeError
    seq = re.search(r"\(call (\d+)\)", repr(stream)).group(1)
    assert str(error) == (
        f"the stream of generate() (call {seq}) is read by one thread: thread 'MainThread' "
        "took its first item, so next() from thread 'reader-2' is refused (two threads "
        "would split its items between them). Read it in that one thread and hand the "
        "items to the others through a queue.Queue, or start one runner.stream(x) per "
        "thread")
    assert in_thread("reader-2", lambda: list(stream))[0] == "raised"  # `for` too
    assert list(stream) == items(5)[1:]  # nothing was lost to the refused thread
    how, error = in_thread("reader-2", lambda: next(stream))  # ended: still the owner's
    assert how == "raised" and "thread 'MainThread' took its first item" in str(error)
    assert counts.healthy and counts.wait_idle(5) is True
    assert counts.generate(2) == items(2)


def test_the_thread_that_takes_the_first_item_owns_the_stream(counts):
    stream = counts.stream(3)  # made here, read by another thread: that one owns it
    assert in_thread("reader", lambda: list(stream)) == ("returned", items(3))
    with pytest.raises(RuntimeError, match="^the stream of generate.* thread 'reader' took "
                                           "its first item, so next.. from thread "
                                           "'MainThread' is refused"):
        next(stream)
    stream.close()  # closing from anywhere is fine
    assert counts.generate(1) == items(1)


def test_one_stream_per_thread_is_the_way(counts):
    got = [in_thread(f"t{t}", lambda: list(counts.stream(3))) for t in range(2)]
    assert got == [("returned", items(3))] * 2


# -- one astream, two tasks --------------------------------------------------------------------
def test_a_second_task_is_refused_while_the_first_awaits_and_loses_nothing(tmp_path):
    seen = tmp_path / "seen"

    async def main() -> None:
        with DistributedRunner(WaitsForTheCaller, world_size=2, init_process_group=False,
                               device="cpu", call_timeout=20.0) as runner:
            stream = runner.astream(str(seen))
            got = [await stream.__anext__()]
            owner = asyncio.create_task(stream.__anext__(), name="owner")
            await asyncio.sleep(0)  # owner awaits item 1: rank 0 waits for the file
            with pytest.raises(RuntimeError) as caught:
                await asyncio.create_task(stream.__anext__(), name="second")
            assert str(caught.value) == (
                "this astream() is read by one task at a time: task 'owner' in thread "
                "'MainThread' is awaiting its next item, so __anext__() from task 'second' "
                "in thread 'MainThread' is refused (two readers would split its items "
                "between them). Read it with one `async for` and hand the items to other "
                "tasks through an asyncio.Queue, or start one runner.astream(x) per task")
            seen.touch()
            got.append(await owner)
            got += [i async for i in stream]
            assert got == ["first", "seen"]  # every item, in order, to the one reader
            assert runner.healthy and await runner.await_idle(5) is True
            assert await runner.agenerate(str(seen)) == ["first", "seen"]

    asyncio.run(main())


def test_tasks_taking_turns_on_one_astream_is_fine(counts):
    async def main() -> list:
        stream = counts.astream(3)
        got = [await asyncio.wait_for(stream.__anext__(), 10) for _ in range(3)]
        return got + [i async for i in stream]

    assert asyncio.run(main()) == items(3)


# -- async for over stream() -------------------------------------------------------------------
def test_async_for_over_stream_says_use_astream_and_leaves_nothing_in_flight(counts):
    async def main() -> list:
        refused = [counts.stream(4), counts.stream(4)]  # held: only leaving them ends them
        with pytest.raises(TypeError) as caught:
            async for _ in refused[0]:
                pass
        assert str(caught.value) == ("stream() is iterated with `for`; in async code use "
                                     "`async for item in runner.astream(x)`")
        with pytest.raises(TypeError) as caught:
            await refused[1]
        assert str(caught.value) == (
            "stream() is not awaited: in async code iterate `async for item in "
            "runner.astream(x)`, or await runner.agenerate(x) for the list")
        assert [i async for i in counts.astream(2)] == items(2)
        return refused

    refused = asyncio.run(main())
    assert [repr(s).endswith(": ended>") for s in refused] == [True, True]
    assert [list(s) for s in refused] == [[], []]
    assert counts.wait_idle(5) is True
    assert counts.healthy and counts.generate(2) == items(2)


def test_a_refused_async_for_gives_its_items_segments_back():
    with DistributedRunner(Frames, world_size=2, init_process_group=False, device="cpu",
                           call_timeout=20.0) as runner:
        runner.generate({"n": 1, "shared": True})
        before = len(our_shm_entries())
        held = []

        async def misuse() -> None:
            held.append(runner.stream({"n": 4, "shared": True}))
            with pytest.raises(TypeError, match="in async code use `async for"):
                async for _ in held[-1]:
                    pass

        for _ in range(4):
            asyncio.run(misuse())
            assert runner.wait_idle(10) is True
        runner.generate({"n": 0})  # carries the last releases
        assert len(our_shm_entries()) <= before + 4  # not 16 frames held in segments


def test_async_for_over_a_stream_being_read_leaves_it_open(counts):
    stream = counts.stream(3)
    assert next(stream) == items(1)[0]

    async def main() -> None:
        with pytest.raises(TypeError, match=r"use `async for item in runner\.astream\(x\)`"):
            async for _ in stream:
                pass

    asyncio.run(main())
    assert list(stream) == items(3)[1:]


# -- areset() / ashutdown() never awaited ------------------------------------------------------
def next_call(runner) -> int:
    """The number the next call sent gets (a stream's repr shows it): what was sent."""
    stream = runner.stream(0)
    assert list(stream) == []
    return int(re.search(r"\(call (\d+)\)", repr(stream)).group(1))


def never_awaited(call) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        call()
        gc.collect()
    return record


def test_areset_never_awaited_warns_at_the_callers_line_and_sends_nothing(counts):
    sent = next_call(counts)
    record = never_awaited(lambda: counts.areset())
    line = inspect.currentframe().f_lineno - 1
    assert [(w.category, str(w.message), w.filename, w.lineno) for w in record] == [(
        RuntimeWarning,
        "runner.areset() was never awaited, so reset() did not run on the ranks: they keep "
        "their session state. In async code write `await runner.areset()`; outside async "
        "code call runner.reset()", __file__, line)]  # and not Python's own warning
    assert next_call(counts) == sent + 1  # nothing was sent in between
    assert counts.healthy


def test_ashutdown_never_awaited_says_the_runner_still_runs(counts):
    record = never_awaited(lambda: counts.ashutdown())
    assert [(w.category, str(w.message)) for w in record] == [(
        RuntimeWarning,
        "runner.ashutdown() was never awaited, so the runner was not shut down: its ranks "
        "keep running until runner.shutdown() or the interpreter's exit. In async code "
        "write `await runner.ashutdown()`; outside async code call runner.shutdown()")]
    assert counts.healthy and counts.generate(1) == items(1)  # as the warning says


def test_awaited_as_before_every_way_and_no_warning():
    runner = DistributedRunner(Counts, world_size=2, init_process_group=False, device="cpu",
                               call_timeout=20.0)

    async def main() -> None:
        await runner.astart()
        sent = next_call(runner)
        await runner.areset()
        await asyncio.create_task(runner.areset())
        await asyncio.gather(runner.areset())
        cancelled = asyncio.create_task(runner.areset())
        cancelled.cancel()  # before it ran: nothing is sent, as with a plain coroutine
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        assert next_call(runner) == sent + 4
        with pytest.raises(ValueError, match="timeout"):
            await runner.areset(timeout=-1)  # checked when awaited, as before
        assert runner.healthy

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        asyncio.run(main())
        asyncio.run(runner.ashutdown())  # asyncio.run takes it like a coroutine
        gc.collect()
    assert [w for w in record if issubclass(w.category, RuntimeWarning)] == []
    assert not runner.healthy and "state=closed" in repr(runner)
