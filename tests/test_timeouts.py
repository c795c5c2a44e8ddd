"""Timeouts (issue 19, point 2): None means no limit wherever a timeout is accepted, and
any positive value works however large (ZeroMQ's RCVTIMEO stops at 2**31 ms, about
24.8 days), with real ranks, sockets and calls; nonsense is refused at once."""

from __future__ import annotations

import asyncio
import math

import pytest
from sample_workers import Echo, Sleep
from test_faults import interrupt_after

from reactor_dist import DistributedRunner

DAYS_30 = 30 * 24 * 3600.0  # past RCVTIMEO's 2**31 ms
HUGE = 1e300  # past every 64-bit count of milliseconds or nanoseconds


@pytest.mark.parametrize("timeout", [None, DAYS_30, HUGE], ids=["None", "30days", "1e300"])
def test_start_timeout_none_or_huge_starts_and_calls(timeout):
    # init_process_group=True: torch's store and group get the timeout too.
    with DistributedRunner(Echo, world_size=2, device="cpu",
                           start_timeout=timeout) as runner:
        assert runner.start_timeout == (None if timeout is None else timeout)
        assert runner.healthy
        assert runner.generate([1, "two"]) == [1, "two"]


@pytest.mark.parametrize("timeout", [None, DAYS_30, HUGE], ids=["None", "30days", "1e300"])
def test_call_timeout_and_per_call_timeout_none_or_huge(timeout):
    with DistributedRunner(Echo, world_size=2, device="cpu", init_process_group=False,
                           call_timeout=timeout) as runner:
        assert runner.call_timeout == timeout
        assert runner.generate("default") == "default"  # call_timeout
        assert runner.generate("given", timeout=timeout) == "given"
        assert runner.reset(timeout=timeout) is None
        assert list(runner.stream("streamed", timeout=timeout)) == ["streamed"]

        async def main() -> list:
            answers = [await runner.agenerate("async", timeout=timeout),
                       await runner.areset(timeout=timeout)]
            answers += [item async for item in runner.astream("astreamed", timeout=timeout)]
            return answers

        assert asyncio.run(main()) == ["async", None, "astreamed"]
        assert runner.healthy


@pytest.mark.parametrize("timeout", [None, DAYS_30, HUGE], ids=["None", "30days", "1e300"])
def test_wait_idle_none_or_huge_waits_for_the_interrupted_call(timeout):
    with DistributedRunner(Echo, world_size=2, device="cpu", init_process_group=False,
                           call_timeout=timeout) as runner:
        with interrupt_after(0.3), pytest.raises(KeyboardInterrupt):
            runner.generate(Sleep(1.0, value="old"))
        assert runner.wait_idle(timeout) is True  # waited for the ranks, not the clock
        with interrupt_after(0.3), pytest.raises(KeyboardInterrupt):
            runner.generate(Sleep(1.0, value="old"))
        assert runner.wait_idle() is True  # the default: call_timeout
        assert runner.generate("new", timeout=timeout) == "new" and runner.healthy


def test_shutdown_grace_none_waits_for_the_graceful_exit():
    runner = DistributedRunner(Echo, world_size=2, device="cpu", init_process_group=False,
                               shutdown_grace=None)
    with runner:
        assert runner.generate(3) == 3
    assert not runner.healthy and repr(runner).endswith("state=closed>")


def test_infinity_means_no_limit():
    runner = DistributedRunner(Echo, call_timeout=math.inf, start_timeout=math.inf)
    assert runner.call_timeout is None and runner.start_timeout is None


@pytest.mark.parametrize("name", ["call_timeout", "start_timeout"])
@pytest.mark.parametrize("value, shown", [
    (0, "got 0"), (-1.5, "got -1.5"), (math.nan, "got nan"), (-math.inf, "got -inf"),
    ("10", "got '10' of type str"), (True, "got True of type bool"),
])
def test_nonsense_timeouts_are_refused_at_construction(name, value, shown):
    with pytest.raises(ValueError) as info:
        DistributedRunner(Echo, **{name: value})
    assert str(info.value) == (f"{name} must be a positive number of seconds or None "
                               f"(no limit), {shown}")


@pytest.mark.parametrize("value", [-1, math.nan, "5"])
def test_nonsense_shutdown_grace_is_refused_at_construction(value):
    with pytest.raises(ValueError) as info:
        DistributedRunner(Echo, shutdown_grace=value)
    assert str(info.value) == (f"shutdown_grace must be 0 or more seconds, or None (no "
                               f"limit), got {value!r} of type {type(value).__name__}")


def test_nonsense_per_call_timeouts_are_refused_before_anything_is_sent():
    with DistributedRunner(Echo, world_size=1, device="cpu", init_process_group=False) as runner:
        for call in (lambda t: runner.generate(1, timeout=t),
                     lambda t: runner.reset(timeout=t),
                     lambda t: runner.stream(1, timeout=t),
                     lambda t: runner.wait_idle(t),
                     lambda t: asyncio.run(runner.agenerate(1, timeout=t))):
            with pytest.raises(ValueError, match=r"^timeout must be a positive number of "
                                                 r"seconds or None \(no limit\), got nan$"):
                call(math.nan)
        assert runner.generate("still", timeout=5) == "still" and runner.healthy
