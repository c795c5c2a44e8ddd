"""Per-call timings, runner.stats() and the straggler warning, with real ranks."""

from __future__ import annotations

import logging
import time

import pytest
from timing_workers import (
    Raises,
    RaisingSteps,
    SlowBeforeAllReduce,
    SlowRank,
    SlowSteps,
    TorchImported,
)

from reactor_dist.caller.timings import CallTimings, Recorder


def test_a_slower_rank_shows_in_compute_and_is_the_slowest(runner_for):
    with runner_for(SlowRank, load_kwargs={"slow": 1, "extra": 0.05}) as runner:
        assert runner.last_timings is None
        began = time.perf_counter()
        assert runner.generate(7) == 7
        caller = time.perf_counter() - began
        t = runner.last_timings
        assert isinstance(t, CallTimings) and len(t.compute) == 2
        assert t.compute[1] >= 0.05  # wall-clock: a lower bound: rank 1 sleeps 50 ms
        # wall-clock: an order: rank 0 returns at once (µs), rank 1 sleeps 50 ms first;
        # load would have to stall rank 0 longer than that inside a call that does nothing
        assert t.compute[0] < t.compute[1]
        assert t.slowest_rank == 1
        # wall-clock: an order: each rank's compute lies inside the caller's wall time
        assert t.wall >= max(t.compute)
        assert t.wall <= caller  # wall-clock: an order: the wall time lies inside `caller`
        assert t.encode >= 0 and t.wait >= 0 and t.decode >= 0  # wall-clock: never negative
        assert t.encode + t.wait + t.decode == pytest.approx(t.wall, abs=1e-9)
        assert t.overhead == pytest.approx(t.wall - t.compute[1])
        assert "slowest_rank=1" in repr(t)


def test_a_generator_workers_compute_is_the_time_inside_the_generator(runner_for):
    with runner_for(SlowSteps) as runner:
        assert list(runner.stream({"n": 3, "pause": 0.02})) == [0, 1, 2]
        t = runner.last_timings
        # wall-clock: lower bounds: 3 pauses of 20 ms on rank 0, of 40 ms on rank 1
        assert t.compute[0] >= 0.06 and t.compute[1] >= 0.12
        # wall-clock: an order: each rank's compute lies inside the caller's wall time
        assert t.slowest_rank == 1 and t.wall >= max(t.compute)
        assert runner.generate({"n": 2, "pause": 0.01}) == [0, 1]
        assert runner.last_timings.compute[1] >= 0.04  # wall-clock: a lower bound: 2 x 20 ms


def test_a_call_that_raises_is_timed_too(runner_for):
    with runner_for(Raises) as runner:
        with pytest.raises(ValueError, match="planned"):
            runner.generate(0.03)
        assert min(runner.last_timings.compute) >= 0.03  # wall-clock: a lower bound: 30 ms
    with runner_for(RaisingSteps) as runner:
        with pytest.raises(ValueError, match="planned"):
            runner.generate(0.03)
        assert min(runner.last_timings.compute) >= 0.03  # wall-clock: a lower bound: 30 ms


def test_stats_count_percentiles_overhead_and_reset(runner_for):
    with runner_for(SlowRank, load_kwargs={"slow": 1, "extra": 0.01}) as runner:
        for i in range(5):
            runner.generate(i)
        stats = runner.stats()
        assert stats.calls == 5
        assert [s.count for s in stats.compute] == [5, 5]
        # wall-clock: a lower bound (rank 1 sleeps 10 ms), then an order: rank 0 returns at
        # once, and load would have to stall it 10 ms in 3 calls of 5 to move its median
        assert stats.compute[1].p50 >= 0.01 and stats.compute[0].p50 < stats.compute[1].p50
        # wall-clock: an order: percentiles of the same values
        assert stats.compute[1].p50 <= stats.compute[1].p90 <= stats.compute[1].p99
        # wall-clock: an order: the overhead is the wall time less rank 1's 10 ms sleep
        assert 0 <= stats.overhead.p50 < stats.wall.p50
        table = str(stats)
        assert "rank 1 compute" in table and "overhead" in table and "p99 ms" in table
        assert runner.stats(reset=True).calls == 5
        assert runner.stats().calls == 0
        runner.generate(0)
        assert runner.stats().calls == 1
        runner.reset_stats()
        assert runner.stats().compute[0].count == 0


def test_timings_can_be_switched_off(runner_for):
    with runner_for(SlowRank, load_kwargs={"slow": None}) as runner:
        runner.record_timings = False
        runner.generate(1)
        assert runner.last_timings is None and runner.stats().calls == 0
        runner.record_timings = True
        runner.generate(1)
        assert runner.last_timings is not None


def stragglers(caplog):
    return [r for r in caplog.records if r.name == "reactor_dist" and "straggler" in r.message]


def test_a_persistently_slow_rank_is_named_once(caplog, runner_for):
    caplog.set_level(logging.WARNING, logger="reactor_dist")
    with runner_for(SlowRank, load_kwargs={"slow": 1, "base": 0.002, "extra": 0.01}) as runner:
        for i in range(45):
            runner.generate(i)
    (record,) = stragglers(caplog)  # rate-limited: one, though the rule held many times
    assert record.levelno == logging.WARNING
    assert record.getMessage().startswith("rank 1 ")
    for hint in ("clocks", "thermals", "processes", "shard", "CPU threads", "ms"):
        assert hint in record.getMessage()


def test_a_balanced_run_warns_of_no_straggler(caplog, runner_for):
    caplog.set_level(logging.WARNING, logger="reactor_dist")
    with runner_for(SlowRank, load_kwargs={"slow": None, "base": 0.005}) as runner:
        for i in range(45):
            runner.generate(i)
    assert stragglers(caplog) == []


def fake(compute):
    return (0.0, 0.0, 0.0, max(compute) + 0.001, tuple(compute))


def test_the_straggler_rule_needs_both_the_ratio_and_the_margin(caplog):
    caplog.set_level(logging.WARNING, logger="reactor_dist")
    small = Recorder(2)  # 1.5x slower, but only 1 ms more: not a straggler
    big = Recorder(2)    # 10 ms more, but under 1.25x: not a straggler
    for _ in range(40):
        small.record(*fake((0.002, 0.003)))
        big.record(*fake((0.100, 0.110)))
    assert stragglers(caplog) == []
    both = Recorder(3)
    for _ in range(40):
        both.record(*fake((0.010, 0.010, 0.020)))
    (record,) = stragglers(caplog)
    assert record.getMessage().startswith("rank 2 ")


WAIT_DECISION = """
import sys, types
from reactor_dist.device import cuda_to_wait_for, wait_for_device
wait_for_device("cpu"); wait_for_device("cuda:1")  # no torch imported: nothing to wait for
print("torch" in sys.modules, cuda_to_wait_for("cpu"), cuda_to_wait_for("cuda:1"))
import torch.cuda  # a CPU build: CUDA never initialised
print(cuda_to_wait_for("cuda:1"))
calls = []
state = types.SimpleNamespace(is_initialized=lambda: True, synchronize=calls.append)
sys.modules["torch.cuda"] = state  # CUDA initialised in this process
wait_for_device("cpu"); wait_for_device("cuda:2")
print(cuda_to_wait_for("cuda:2") is state, calls)
state.is_initialized = lambda: False
wait_for_device("cuda:2")
print(calls)
"""


def test_a_rank_waits_for_its_gpu_only_on_a_cuda_device_with_cuda_initialised():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", WAIT_DECISION], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["False None None", "None", "True ['cuda:2']",
                                       "['cuda:2']"]


def test_timing_a_cpu_rank_never_imports_torch(runner_for):
    with runner_for(TorchImported) as runner:
        assert runner.generate(0) is False
        runner.reset()
        assert list(runner.stream("steps")) == [False, False]
        assert runner.generate(0) is False


def test_a_rank_slow_before_an_all_reduce_is_named_by_its_busy_time(caplog, runner_for):
    # Rank 1 sleeps 20 ms before an all_reduce: rank 0 waits inside it, so both ranks'
    # compute is ~20 ms; their collective waits and busy times tell them apart.
    caplog.set_level(logging.WARNING, logger="reactor_dist")
    with runner_for(SlowBeforeAllReduce, init_process_group=True,
                    load_kwargs={"slow": 1, "extra": 0.02}) as runner:
        for i in range(40):
            assert runner.generate(i) == 8.0 + i
        t = runner.last_timings
        assert len(t.collective_wait) == 2 and len(t.busy) == 2
        # wall-clock: rank 0 waits for rank 1's 20 ms head start, less the ranks' skew in
        # starting the call (load lengthens it): 5 ms is a quarter of the head start, and
        # still above a wait not measured (0) or a balanced run's (the skew alone); rank 1's
        # busy time is a lower bound: its 20 ms sleep
        assert t.collective_wait[0] >= 0.005 and t.busy[1] >= 0.02
        # wall-clock: orders: rank 1 sleeps 20 ms, rank 0 waits for it; a skew of 20 ms
        # between the ranks would be needed to turn them round
        assert t.busy[0] < t.busy[1] and t.collective_wait[1] < t.collective_wait[0]
        assert t.busy == pytest.approx([c - w for c, w in
                                        zip(t.compute, t.collective_wait, strict=True)])
        assert t.slowest_rank == 1 and "collective_wait=(" in repr(t)
        stats = runner.stats()
        assert [s.count for s in stats.busy] == [40, 40]
        assert [s.count for s in stats.collective_wait] == [40, 40]
        assert stats.busy[1].p50 > stats.busy[0].p50  # wall-clock: an order, as above
        # wall-clock: an order, as above (of medians over 40 calls)
        assert stats.collective_wait[0].p50 > stats.collective_wait[1].p50
        names = [" ".join(line.split()[:-4]) for line in str(stats).splitlines()[1:]]
        assert names == ["rank 0 compute", "rank 1 compute", "rank 0 busy", "rank 1 busy",
                         "rank 0 collective wait", "rank 1 collective wait", "overhead",
                         "wall"]
    (record,) = stragglers(caplog)
    assert record.getMessage().startswith("rank 1 is a straggler: its median busy time")


@pytest.mark.parametrize("how", ["sync", "async", "imported"])
def test_a_balanced_run_with_an_all_reduce_warns_of_no_straggler(caplog, how, runner_for):
    caplog.set_level(logging.WARNING, logger="reactor_dist")
    with runner_for(SlowBeforeAllReduce, init_process_group=True,
                    load_kwargs={"slow": None, "base": 0.005, "how": how}) as runner:
        for i in range(40):
            assert runner.generate(i) == 8.0 + i
        waits = runner.last_timings.collective_wait
        # wall-clock: a lower bound: an all_reduce takes some time however idle the machine
        assert len(waits) == 2 and all(w > 0 for w in waits)
        assert runner.stats().collective_wait[0].count == 40
    assert stragglers(caplog) == []


@pytest.mark.parametrize("how", ["async", "imported"])
def test_an_async_or_imported_all_reduce_is_timed_too(caplog, how, runner_for):
    caplog.set_level(logging.WARNING, logger="reactor_dist")
    with runner_for(SlowBeforeAllReduce, init_process_group=True,
                    load_kwargs={"slow": 1, "extra": 0.02, "how": how}) as runner:
        for i in range(20):
            runner.generate(i)
        t = runner.last_timings
        # wall-clock: rank 0 waits for rank 1's 20 ms head start, less the skew: 5 ms is a
        # quarter of it (see the test above)
        assert t.collective_wait[0] >= 0.005 and t.slowest_rank == 1
    (record,) = stragglers(caplog)
    assert record.getMessage().startswith("rank 1 ")


def test_ranks_without_a_group_measure_no_collective_wait(runner_for):
    with runner_for(SlowRank, load_kwargs={"slow": 1, "extra": 0.01}) as runner:
        runner.generate(1)
        t = runner.last_timings
        assert t.collective_wait == (0.0, 0.0) and t.busy == t.compute
        assert "busy" not in str(runner.stats())
