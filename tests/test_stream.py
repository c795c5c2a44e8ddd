"""``runner.stream()``: rank 0's items as they are made, the error contract per stream,
leaving early, and a fault matrix with a stream phase (real processes throughout)."""

from __future__ import annotations

import gc
import os
import signal
import threading
import time

import pytest
from conftest import our_shm_entries, segment_of, wait_gone
from probe import Probe
from sample_workers import FAULT_MEANS, Echo
from stream_workers import (
    Counts,
    Frames,
    RaisesAfter,
    Slow,
    StreamFault,
    WaitsForTheCaller,
    YieldsUnpicklable,
)

from reactor_dist import (
    RankDesync,
    WorkerCrashed,
    WorkerTimeout,
)


@pytest.fixture
def counts(runner_for):
    with runner_for(Counts) as runner:
        yield runner


@pytest.fixture
def frames(runner_for):
    with runner_for(Frames) as runner:
        yield runner


# -- what a stream yields ----------------------------------------------------------------------
def test_rank_0s_items_arrive_in_order_and_the_others_are_ignored(counts):
    assert list(counts.stream(4)) == [{"i": i, "rank": 0} for i in range(4)]


def test_generate_on_a_generator_worker_returns_the_list_of_items(counts):
    assert counts.generate(3) == [{"i": i, "rank": 0} for i in range(3)]
    assert counts.generate(0) == []
    assert list(counts.stream(0)) == []


def test_a_plain_worker_streams_its_one_value(runner_for):
    with runner_for(Echo) as runner:
        assert list(runner.stream({"x": 1})) == [{"x": 1}]
        assert runner.generate(5) == 5


def test_an_item_reaches_the_caller_while_the_step_still_runs(tmp_path, runner_for):
    flag = str(tmp_path / "caller-has-item-0")
    with runner_for(WaitsForTheCaller) as runner:
        stream = runner.stream(flag)
        assert next(stream) == "first"
        open(flag, "w").close()  # rank 0 waits for this before it yields again
        assert list(stream) == ["seen"]


@pytest.mark.parametrize("shared", [False, True], ids=["plain", "shared_empty"])
def test_big_items_come_through_shared_memory(frames, shared):
    items = list(frames.stream({"n": 3, "shared": shared}))
    prefix = Probe(frames).shm_prefix
    for i, frame in enumerate(items):
        assert frame.shape == (4 << 20,) and frame[0] == i and frame[-1] == i
        assert frame.base is not None and not frame.flags.owndata  # a view, not a copy
        assert (segment_of(frame.ctypes.data) or "").startswith(f"/dev/shm/{prefix}.")


def test_items_stay_valid_after_the_stream_later_calls_and_an_error(frames):
    kept = list(frames.stream({"n": 2, "shared": True})) + list(frames.stream({"n": 2}))
    for _ in range(3):
        frames.generate({"n": 2})
    with pytest.raises(TypeError):
        frames.generate({"n": "not a number"})
    assert [int(f[0]) for f in kept] == [0, 1, 0, 1]
    assert all(int(f[-1]) == int(f[0]) for f in kept)


# -- timeout and the error contract, per stream ------------------------------------------------
def test_the_timeout_bounds_each_item_not_the_whole_step(runner_for):
    with runner_for(Slow) as runner:
        started = time.monotonic()
        assert list(runner.stream({"n": 5, "pause": 0.2}, timeout=0.6)) == [0, 1, 2, 3, 4]
        # wall-clock: a lower bound: five 0.2 s pauses take 1 s at least, longer than one
        # timeout in all, and load only lengthens them
        assert time.monotonic() - started > 0.6


@pytest.mark.parametrize("rank", [0, 1])
def test_a_hang_between_items_is_a_timeout_after_the_items_before_it(rank, runner_for):
    runner = runner_for(Slow)
    with runner:
        got = []
        with pytest.raises(WorkerTimeout, match=f"no answer from rank {rank}"):
            for item in runner.stream({"n": 4, "hang_after": 2, "hang_rank": rank},
                                      timeout=0.5):
                got.append(item)
        assert got == ([0, 1] if rank == 0 else [0, 1, 2, 3])
        assert not runner.healthy
        with pytest.raises(RuntimeError, match="unusable"):
            runner.stream(1)


def test_the_same_exception_everywhere_comes_after_the_items_and_the_runner_stays_healthy(
        runner_for):
    with runner_for(RaisesAfter) as runner:
        got = []
        with pytest.raises(ValueError, match="bad item on rank 0") as info:
            for item in runner.stream({"after": 2, "errors": ["value", "value"]}):
                got.append(item)
        assert got == [0, 1]
        assert "remote traceback" in str(info.value.__cause__)
        assert runner.healthy
        assert runner.generate({"after": 3, "errors": [None, None]}) == [0, 1, 2]


@pytest.mark.parametrize("errors, message", [
    (["value", "key"], "ranks raised different exception types in generate(): rank 0 raised "
                       "ValueError, rank 1 raised KeyError"),
    ([None, "value"], "rank 1 raised ValueError in generate() while rank 0 returned"),
])
def test_disagreeing_ranks_are_a_desync(errors, message, runner_for):
    with runner_for(RaisesAfter) as runner:
        got = []
        with pytest.raises(RankDesync) as info:
            for item in runner.stream({"after": 2, "errors": errors}):
                got.append(item)
        assert got == [0, 1] and message in str(info.value)
        assert not runner.healthy
        with pytest.raises(RuntimeError, match="unusable"):
            runner.generate({"after": 1, "errors": [None, None]})


UNPICKLABLE_ITEM = (
    "item 1 of generate() on rank 0 (a function) cannot be pickled (AttributeError: Can't "
    "pickle local object 'YieldsUnpicklable.generate.<locals>.<lambda>'): yield numpy arrays, "
    "tensors, plain Python data, or instances of a class defined at the top level of a module")


def test_an_unpicklable_item_is_an_error_naming_it_and_the_runner_stays_healthy(runner_for):
    with runner_for(YieldsUnpicklable) as runner:
        got = []
        with pytest.raises(TypeError) as info:
            for item in runner.stream(3):
                got.append(item)
        assert str(info.value) == UNPICKLABLE_ITEM
        assert got == [0]
        assert runner.healthy
        with pytest.raises(TypeError) as info:
            runner.generate(3)
        assert str(info.value) == UNPICKLABLE_ITEM
        assert runner.healthy
        assert list(runner.stream(1)) == [0]


# -- leaving early -----------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["break", "close", "collected"])
def test_leaving_early_lets_the_step_end_and_the_next_call_gets_its_own_result(frames, how):
    before = len(our_shm_entries())
    for _ in range(4):
        stream = frames.stream({"n": 6})
        if how == "break":
            for _frame in stream:
                break
            del _frame
        elif how == "close":
            next(stream)
            stream.close()
            stream.close()  # twice is fine
            assert list(stream) == []
        del stream
        gc.collect()
        out = frames.generate({"n": 2, "shared": True})
        assert [int(f[0]) for f in out] == [0, 1]
        del out
    assert frames.healthy
    gc.collect()
    frames.generate({"n": 0})  # carries the last releases
    assert len(our_shm_entries()) <= before + 6  # the dropped items' segments were reused


def test_a_call_from_the_same_thread_is_sent_behind_an_open_stream(counts):
    """A stream is one call in the queue: the next call goes behind it, and the stream's
    items wait for it, in order, while that call is answered."""
    stream = counts.stream(3)
    assert next(stream) == {"i": 0, "rank": 0}
    assert counts.generate(1) == [{"i": 0, "rank": 0}]
    assert list(stream) == [{"i": 1, "rank": 0}, {"i": 2, "rank": 0}]
    assert counts.generate(1) == [{"i": 0, "rank": 0}]


def test_a_call_from_another_thread_runs_while_a_stream_is_open(counts):
    stream = counts.stream(2)
    done = []
    thread = threading.Thread(target=lambda: done.append(counts.generate(1)))
    thread.start()
    thread.join(timeout=10)
    assert done == [[{"i": 0, "rank": 0}]]  # nobody had to read the stream first
    assert list(stream) == [{"i": 0, "rank": 0}, {"i": 1, "rank": 0}]


def test_ctrl_c_during_a_stream_keeps_the_runner_usable(runner_for):
    with runner_for(Slow) as runner:
        # The first item comes 1.5 s after the ranks begin: the Ctrl-C at 0.2 s lands
        # while next() waits for it, with room for a loaded machine (0.4 s had too little).
        stream = runner.stream({"n": 2, "pause": 1.5})
        timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            next(stream)
        timer.join()
        assert list(stream) == []  # the interrupted stream has ended
        assert runner.healthy
        assert runner.generate({"n": 2}) == [0, 1]


def test_stream_on_an_unusable_or_shut_down_runner_is_refused(runner_for):
    runner = runner_for(Counts)
    with pytest.raises(RuntimeError, match="start"):
        runner.stream(1)
    runner.start()
    runner.shutdown()
    with pytest.raises(RuntimeError, match="unusable"):
        runner.stream(1)


# -- the fault matrix, stream phase --------------------------------------------------------------
WHERE = ("before", "between", "after")
ITEMS_BEFORE = {"before": 0, "between": 1, "after": 3}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("means", FAULT_MEANS)
@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("where", WHERE)
def test_stream_fault_matrix(where, rank, means, tmp_path, runner_for):
    fault = {"phase": "stream", "rank": rank, "means": means, "stamp_dir": str(tmp_path),
             "where": where}
    timeout = 0.5 if means == "hang" else 10.0
    runner = runner_for(StreamFault, call_timeout=timeout, shutdown_grace=1.0)
    runner.start()
    probe = Probe(runner)
    pids, prefix, ipc_dir = probe.processes(), probe.shm_prefix, probe.ipc_dir
    got = []
    try:
        with pytest.raises(BaseException) as info:
            for item in runner.stream(fault):
                got.append(int(item[0]))
        stamp = float(open(os.path.join(str(tmp_path), f"stream-{rank}")).read())
        reported = time.time() - stamp
        if means == "raise":  # one rank raised, the other finished
            assert info.type is RankDesync
            assert f"rank {rank} raised sample_workers.InjectedFault" in str(info.value)
        elif means == "hang":
            assert info.type is WorkerTimeout
            assert f"no answer from rank {rank} within 0.5 s" in str(info.value)
            # wall-clock: 0.54-0.55 s on an idle machine (the 0.5 s timeout and the stacks),
            # 2 s is 3.6x that; a timeout that never fired would hang until pytest's
            assert reported < 2.0, f"{reported:.2f} s"
        else:
            assert info.type is WorkerCrashed
            assert f"rank {rank}" in str(info.value)
            # wall-clock: the documented bound (within 1 s of the death): 4-13 ms on an idle
            # machine, 1 s is 75x that; a death not seen would be the 10 s call_timeout
            assert reported < 1.0, f"{reported:.2f} s"
        # Before an error or a hang, every item rank 0 made reaches the caller: all of
        # them when the fault is on rank 1. A crash may overtake items still in flight
        # (the death notice does not queue behind them): some first ones arrive, in order.
        made = ITEMS_BEFORE[where] if rank == 0 else 3
        if means in ("raise", "hang"):
            assert got == list(range(made))
        else:
            assert got == list(range(len(got))) and len(got) <= made
        assert not runner.healthy
    finally:
        runner.shutdown()
    assert wait_gone(pids, timeout=2.0) == []
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(prefix + ".")]
    assert not os.path.exists(ipc_dir)


def test_a_stream_left_open_in_another_thread_holds_up_no_call(counts):
    stream = None

    def open_stream() -> None:
        nonlocal stream
        stream = counts.stream(2)
        next(stream)

    opener = threading.Thread(target=open_stream)
    opener.start()
    opener.join(10)
    assert counts.generate(1, timeout=0.3) == [{"i": 0, "rank": 0}]
    assert counts.healthy
    stream.close()
    assert counts.wait_idle(5) is True
    assert counts.generate(1) == [{"i": 0, "rank": 0}]
