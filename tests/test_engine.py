"""The engine (reactor_dist.caller.engine) without I/O: its rule read in its source, and
its moves driven by hand, with no process, socket or thread, as a sans-I/O core is.

Everything it does with real ranks is tested through the runner by the other tests;
here it is given what happened (a call sent, the time, a failure) and what it answers
is checked: the state, what settles, and what it asks its driver to do, in order.
"""

from __future__ import annotations

import ast
import logging
import pathlib
from concurrent.futures import Future

import pytest

from reactor_dist import WorkerCrashed, WorkerTimeout
from reactor_dist.caller import engine as engine_module
from reactor_dist.caller.calls import Call
from reactor_dist.caller.engine import (
    CLOSED,
    HEALTHY,
    NEW,
    RESTARTING,
    UNUSABLE,
    Do,
    Engine,
)
from reactor_dist.caller.timings import Recorder
from reactor_dist.errors import RankFailure

SOURCE = pathlib.Path(engine_module.__file__).read_text()
# What a module needs to do I/O, wait or start work of its own; the engine imports none.
NO_IO_IMPORTS = {"asyncio", "os", "select", "selectors", "signal", "socket", "subprocess",
                 "threading", "time", "zmq", "mmap", "psutil"}
# Methods that send, receive, wait or start: the engine calls none of them.
NO_IO_CALLS = {"send", "send_numbered", "send_again", "publish", "receive", "recv",
               "tell_answered", "owe_answered", "take_output", "sleep", "wait",
               "start", "acquire", "notify", "notify_all", "unlink",
               "unlink_quietly", "timed_out", "crashed", "begun", "dead", "flush"}


def test_the_engine_imports_nothing_that_does_io_and_calls_no_io():
    tree = ast.parse(SOURCE)
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and \
                [a.name for a in node.names] != ["perf_counter"]:  # timings, not deadlines
            imported.add((node.module or "").split(".")[0])
    assert imported & NO_IO_IMPORTS == set()
    called = {node.func.attr for node in ast.walk(tree)
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)}
    assert called & NO_IO_CALLS == set()
    assert "monotonic()" not in SOURCE  # deadlines come as `now`


def the_engine(**kwargs) -> Engine:
    engine = Engine(2, 2, Recorder(2), **kwargs)
    engine.open(codec=None)  # no message is fed here: nothing to decode
    return engine


def a_call(seq: int, timeout: float | None = 5.0) -> Call:
    return Call(seq, "generate", timeout)


def crash(*ranks: int) -> WorkerCrashed:
    error = WorkerCrashed(f"rank {', '.join(map(str, ranks))} died during generate()")
    error.failures = tuple(RankFailure(rank, None, "here", "cpu", False) for rank in ranks)
    return error


def test_a_call_sent_starts_its_clock_only_when_the_ranks_start_it():
    engine = the_engine()
    assert engine.state is HEALTHY and engine.free_to_send()
    first, second = a_call(1), a_call(2)
    assert engine.sent(first, None, now=100.0, future=None) is False
    assert engine.sent(second, None, now=101.0, future=None) is False
    assert (first.deadline, second.deadline) == (105.0, None)
    assert not engine.free_to_send()  # max_in_flight=2 reached
    assert engine.overdue(104.9) is None
    assert engine.overdue(105.0) is first
    assert engine.busy() == [0, 1]


def test_a_timeout_fails_the_call_and_every_call_behind_it_and_asks_for_the_log_in_order():
    engine = the_engine()
    first, second = a_call(1), a_call(2)
    future: Future = Future()
    engine.sent(first, None, 0.0, None)
    engine.sent(second, None, 0.0, future)
    assert list(engine.todo) == [(Do.WANT_COLLECTOR, None)]  # nobody watches the future's
    engine.todo.clear()
    error = WorkerTimeout("no answer from rank 1 within 5 s during generate() (call 1)")
    engine.broken(error, engine.overdue(10.0))
    assert engine.state is UNUSABLE and engine.failure is error
    assert first.error is error
    assert type(second.error) is WorkerTimeout and "call 1" in str(second.error)
    assert list(engine.settled) == [second]  # the driver settles its future, unlocked
    assert [do for do, _ in engine.todo] == [Do.TAKE_OUTPUT, Do.LOG]
    assert engine.todo[1][1][0] == logging.ERROR
    assert engine.in_flight == type(engine.in_flight)() and engine.by_seq == {}
    with pytest.raises(RuntimeError, match="unusable: WorkerTimeout"):
        engine.check_usable()


class Budget:
    """One restart allowed: what restart.Restarts decides, without its thread."""

    def __init__(self) -> None:
        self.asked: list[BaseException] = []

    def after_failure(self, exc: BaseException) -> str | None:
        self.asked.append(exc)
        return "the runner is restarting (restart 1 of max_restarts=1)" \
            if len(self.asked) == 1 else None

    def budget_note(self) -> str:
        return " (budget spent)"


def test_a_crash_with_a_budget_asks_the_driver_to_start_the_restart_and_keeps_retries():
    budget = Budget()
    engine = the_engine(restarts=budget, retry_failed=True)
    kept = a_call(1)
    kept.command = object()  # type: ignore[assignment]  # sent with a session: may go again
    plain = a_call(2)
    engine.sent(kept, None, 0.0, None)
    engine.sent(plain, None, 0.0, None)
    engine.todo.clear()
    error = crash(1)
    engine.broken(error, kept)
    assert engine.state is RESTARTING
    assert [do for do, _ in engine.todo] == [Do.TAKE_OUTPUT, Do.START_RESTART, Do.LOG]
    assert [call for call, _ in engine.retrying] == [kept] and not kept.done
    assert plain.done and "restarting" in str(plain.error)
    assert engine.restart_ended(None) == [(kept, error)]
    assert engine.state is HEALTHY and engine.retrying == []
    assert engine.resent(kept, 7, now=50.0) is False
    assert (kept.seq, kept.deadline, engine.retried) == (7, 55.0, 1)
    engine.broken(crash(0))  # the budget is spent: unusable
    assert engine.state is UNUSABLE
    with pytest.raises(RuntimeError, match=r"\(budget spent\)\. runner.restart\(\)"):
        engine.check_usable()


def test_turns_are_first_come_first_served_and_a_full_queue_is_said():
    engine = the_engine()
    engine.sent(a_call(1), None, 0.0, None)
    engine.sent(a_call(2), None, 0.0, None)
    first, second = engine.take_turn(), engine.take_turn()
    assert not engine.may_send(first) and not engine.may_send(second)
    engine.in_flight.popleft()  # (as if answered)
    assert engine.may_send(first) and not engine.may_send(second)
    engine.leave_turn(first)
    assert engine.changed and engine.may_send(second)
    full = engine.not_sent("generate", 0.5)
    assert "generate() waited 0.5 s for its turn" in str(full)


def test_a_death_names_the_call_the_dead_rank_began():
    engine = the_engine()
    calls = [a_call(seq) for seq in (1, 2, 3)]
    engine.max_in_flight = 3
    for call in calls:
        engine.sent(call, None, 0.0, None)
    calls[0].replies[1] = ({}, [])  # rank 1 answered call 1 only
    assert engine.owes_before({1: 2}) is False  # its ring: it began call 2
    assert engine.owes_before({1: 3}) is True  # it began 3: its reply to 2 is on its way
    assert engine.died_in([1], begun=2) is calls[1]
    assert engine.died_in([1], begun=0) is calls[1]  # no ring: the first it owes
    assert engine.died_in([0], begun=0) is calls[0]


def test_illegal_moves_raise_and_a_closed_engine_fails_what_is_in_flight():
    engine = Engine(1, 1, Recorder(1))
    assert engine.state is NEW
    with pytest.raises(RuntimeError, match="start\\(\\) has not run"):
        engine.check_usable()
    with pytest.raises(RuntimeError, match="cannot move from new to restarting"):
        engine.move(RESTARTING)
    engine.open(codec=None)
    call = a_call(1)
    engine.sent(call, None, 0.0, None)
    engine.close()
    assert engine.state is CLOSED
    assert "still in flight when the runner was shut down" in str(call.error)
    with pytest.raises(RuntimeError, match="was shut down: restart"):
        engine.begin_restart()
