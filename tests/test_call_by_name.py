"""Worker methods called by name on every rank (runner.call, call_all, acall, acall_all):
in order with the calls in flight, under generate()'s whole contract, checked before
anything is sent, journaled and replayed with sessions."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from call_workers import GainedRollout, Tunable
from conftest import segment_of
from session_workers import Die

from reactor_dist import DistributedRunner, RankDesync, WorkerCrashed, WorkerTimeout

XS = [1.0, 2.0, 3.0, 4.0, 5.0]


@pytest.fixture(scope="module", params=[2, 3], ids=["ws2", "ws3"])
def tunable(request):
    with DistributedRunner(Tunable, world_size=request.param, device="cpu") as runner:
        yield runner


@pytest.fixture(autouse=True)
def nothing_left_behind():
    """Overrides conftest's: the module runner lives across tests."""
    yield


def test_call_returns_rank_0s_result_and_call_all_every_ranks(tunable):
    ws = tunable.world_size
    assert tunable.call("set_gain", 2.0, offset=0.5) == (0, 2.5)
    assert tunable.generate(2.0) == 5.0 * ws  # every rank took the gain
    assert tunable.call_all("set_gain", 1.0) == [(rank, 1.0) for rank in range(ws)]
    assert tunable.call("generate", 3.0) == 3.0 * ws  # generate by name: the same call
    tunable.call("reset")
    assert tunable.call_all("history")[-1][-2:] == ["generate", "reset"]


def test_call_all_results_come_through_each_ranks_shared_memory(tunable):
    got = tunable.call_all("frames", 1 << 18)  # 2 MiB each
    assert [a.shape for a in got] == [(1 << 18,)] * tunable.world_size
    for rank, array in enumerate(got):
        assert (array == rank).all()
        assert f".r{rank}-" in segment_of(array.ctypes.data)  # rank's own pool, no copy


def test_calls_by_name_run_in_order_with_the_calls_in_flight(tunable):
    ws = tunable.world_size
    tunable.call("set_gain", 1.0)
    first = tunable.submit(1.0)
    second = tunable.submit(1.0)
    assert tunable.call("set_gain", 10.0) == (0, 10.0)  # after both, before the next
    third = tunable.submit(1.0)
    assert [f.result(timeout=30) for f in (first, second, third)] == [ws, ws, 10.0 * ws]
    tunable.call("set_gain", 1.0)


def test_asyncio_forms(tunable):
    async def main():
        return (await tunable.acall("set_gain", 3.0),
                await tunable.acall_all("set_gain", 1.0),
                await tunable.agenerate(1.0))

    ws = tunable.world_size
    assert asyncio.run(main()) == ((0, 3.0), [(r, 1.0) for r in range(ws)], 1.0 * ws)


BAD = [
    (("nope",), AttributeError,
     "call('nope'): Tunable has no method 'nope'; call() runs a public method the worker "
     "class defines: die_on, frames, generate, history, raise_on, report_progress, reset, "
     "set_gain, shared_empty, sleep_on, to_device"),
    (("_secret",), ValueError,
     "call('_secret'): a private name; call() runs a public method of Tunable on every rank "
     "(a name without a leading underscore)"),
    (("load",), ValueError,
     "call('load'): load() is the runner's to call (load at start, rejoin at a restart, "
     "snapshot and restore for sessions); call() runs generate, reset and your own methods"),
    ((7,), TypeError, "call() takes the name of a worker method as a str, got 7"),
    (("generate", 1, 2), TypeError,
     "call('generate', ...) takes the input alone, as generate(input) does; got 2 "
     "positional and 0 keyword arguments"),
    (("reset", 1), TypeError, "call('reset') takes no arguments, as reset() does"),
]


@pytest.mark.parametrize("args,kind,message", BAD, ids=[str(b[0]) for b in BAD])
def test_a_wrong_name_is_an_error_before_anything_is_sent(tunable, args, kind, message):
    sent = tunable.call_all("history")[0]
    with pytest.raises(kind) as err:
        tunable.call(*args)
    assert str(err.value) == message
    assert tunable.call_all("history")[0] == sent  # nothing ran in between
    assert tunable.generate(1.0) == tunable.world_size


def test_call_all_refuses_generate(tunable):
    with pytest.raises(ValueError) as err:
        tunable.call_all("generate", 1.0)
    assert str(err.value) == (
        "call_all('generate', ...): generate()'s result is rank 0's; return what every rank "
        "should report from a method of your own and call_all() that")


def test_every_rank_raising_the_same_keeps_the_runner_healthy(tunable):
    ranks = list(range(tunable.world_size))
    with pytest.raises(ValueError, match="no gain for rank 0"):
        tunable.call("raise_on", ranks)
    with pytest.raises(ValueError, match="no gain for rank 0"):
        tunable.call_all("raise_on", ranks)
    assert tunable.call_all("raise_on", []) == ["fine"] * tunable.world_size


def test_one_rank_raising_is_a_desync_and_a_restart_heals_it():
    with DistributedRunner(Tunable, world_size=2, device="cpu") as runner:
        with pytest.raises(RankDesync) as err:
            runner.call("raise_on", [1])
        assert str(err.value).startswith(
            "rank 1 raised ValueError in raise_on() while rank 0 returned: the ranks are out "
            "of step; the runner is unusable")
        runner.restart()
        assert runner.call("set_gain", 2.0) == (0, 2.0)


def test_a_hang_is_a_timeout_and_a_death_a_crash():
    with DistributedRunner(Tunable, world_size=2, device="cpu", call_timeout=2.0) as runner:
        with pytest.raises(WorkerTimeout) as err:
            runner.call("sleep_on", 1, 30.0)
        assert "no answer from rank 1 within 2 s during sleep_on() (call 1)" in str(err.value)
        runner.restart()
        with pytest.raises(WorkerCrashed) as err:
            runner.call_all("die_on", 0)
        assert "rank 0 died during die_on() (call 2)" in str(err.value)  # numbers go on
        runner.restart()
        assert runner.call_all("set_gain", 1.0) == [(0, 1.0), (1, 1.0)]


def test_a_called_method_is_journaled_and_replayed_with_the_session(tmp_path):
    """The gain taken by name before the fault is in the replayed session: the answers
    after it equal an uninterrupted run's."""
    plan = [("g", XS[0]), ("call", 2.0), ("g", XS[1]), ("g", XS[2]), ("call", 0.5),
            ("g", XS[3]), ("g", XS[4])]

    def run(runner, die_at=None):
        out = []
        for index, (what, x) in enumerate(plan):
            if what == "call":
                runner.call("set_gain", x)
            elif index == die_at:
                out.append(runner.generate(Die(x, 1, str(tmp_path / "died"))))
            else:
                out.append(runner.generate(x))
        return out

    options = dict(world_size=2, device="cpu", snapshot_every=3, max_restarts=1,
                   retry_failed=True, load_kwargs={"state_dir": str(tmp_path)})
    with DistributedRunner(GainedRollout, **options) as runner:
        expected = run(runner)
    (tmp_path / "died").unlink(missing_ok=True)
    with DistributedRunner(GainedRollout, **options) as runner:
        got = run(runner, die_at=5)
        stats = runner.stats()
    assert all(np.array_equal(a, b) for a, b in zip(got, expected, strict=True))
    assert runner.restarts == 1
    assert stats.replayed == 2 and stats.replay_differences == 0  # set_gain(0.5), g(XS[3])
