"""Sessions that survive a fault (issue 32): ``snapshot_every=K`` keeps every rank's
``snapshot()`` and the calls since; every restart restores it and runs those calls
again, and ``retry_failed=True`` sends the calls a fault failed again, so the caller
gets their results.  Every result is compared, exactly, with an uninterrupted rollout
computed in this process (session_workers.reference)."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
from conftest import our_shm_entries
from probe import Probe
from session_workers import (
    SIZE,
    Die,
    DieAlways,
    Dies,
    FrameRollout,
    NoHooks,
    Noisy,
    RejoiningRollout,
    RestoreRaises,
    Rollout,
    SnapshotRaises,
    Streaming,
    frame_reference,
    reference,
)

from reactor_dist import DistributedRunner, WorkerCrashed
from reactor_dist.wire.protocol import snapshot_tag

XS = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]


def make(worker: type = RejoiningRollout, world_size: int = 2, state_dir=None, **kw
         ) -> DistributedRunner:
    kw.setdefault("device", "cpu")
    kw.setdefault("call_timeout", 30.0)
    kw.setdefault("start_timeout", 90.0)
    kw.setdefault("shutdown_grace", 1.0)
    kw.setdefault("snapshot_every", 3)
    return DistributedRunner(worker, world_size=world_size,
                             load_kwargs={"state_dir": str(state_dir) if state_dir else None},
                             **kw)


def pids_of(state_dir, what: str, rank) -> list[int]:
    path = os.path.join(str(state_dir), f"{what}-{rank}")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [int(line) for line in f]


# -- construction ---------------------------------------------------------------------------
def test_snapshots_need_both_hooks_and_retries_need_snapshots_and_restarts():
    with pytest.raises(ValueError, match=r"snapshot_every=2 needs snapshot\(self\) -> state "
                                         r"and restore\(self, state\) on NoHooks, which lacks "
                                         r"snapshot and restore\(\)"):
        DistributedRunner(NoHooks, snapshot_every=2)
    with pytest.raises(ValueError, match=r"snapshot_every must be an int >= 0 \(calls between "
                                         r"two snapshots of the session; 0: none\), got -1"):
        DistributedRunner(Rollout, snapshot_every=-1)
    with pytest.raises(ValueError, match=r"retry_failed=True .* needs snapshot_every >= 1 and "
                                         r"max_restarts >= 1 \(got snapshot_every=0, "
                                         r"max_restarts=1\)"):
        DistributedRunner(Rollout, retry_failed=True, max_restarts=1)
    with pytest.raises(ValueError, match=r"got snapshot_every=2, max_restarts=0"):
        DistributedRunner(Rollout, retry_failed=True, snapshot_every=2)
    with pytest.raises(ValueError, match="retry_failed must be True or False, got 1"):
        DistributedRunner(Rollout, retry_failed=1, snapshot_every=2, max_restarts=1)
    DistributedRunner(NoHooks)  # no snapshots: no hooks needed


# -- restart() restores the session --------------------------------------------------------
@pytest.mark.parametrize("after", [0, 1, 2], ids=["right-after-a-snapshot", "one-later",
                                                 "two-later"])
def test_after_restart_the_next_calls_equal_an_uninterrupted_run(tmp_path, after):
    """K=3: snapshots after calls 3 and 6; the crash comes in the call ``after`` calls
    past the one right after the snapshot of call 3 (call 4, 5 or 6)."""
    expected = reference(XS, 2)
    crash_at = 3 + after
    with make(state_dir=tmp_path) as runner:
        for i in range(crash_at):
            assert np.array_equal(runner.generate(XS[i]), expected[i])
        with pytest.raises(WorkerCrashed, match=r"rank 1 died during generate\(\)"):
            runner.generate(Die(XS[crash_at], 1, str(tmp_path / "died")))
        runner.restart()
        for i in range(crash_at, len(XS)):  # the failed call's x again, then the rest
            assert np.array_equal(runner.generate(XS[i]), expected[i]), i
        stats = runner.stats()
        assert (stats.replayed, stats.replay_differences) == (after, 0)
        assert len(pids_of(tmp_path, "load", 1)) == 2  # rank 1: a new process
        assert len(pids_of(tmp_path, "load", 0)) == 1  # rank 0 kept its model ...
        assert len(pids_of(tmp_path, "rejoin", 0)) == 1  # ... and restored the snapshot


@pytest.mark.parametrize("victim", [0, 1])
@pytest.mark.parametrize("mode", ["kept", "spare", "new-processes"])
def test_kept_ranks_a_spare_and_new_processes_all_restore(tmp_path, victim, mode):
    worker = Rollout if mode == "new-processes" else RejoiningRollout
    spares = 1 if mode == "spare" else 0
    expected = reference(XS, 2)
    with make(worker, state_dir=tmp_path, spares=spares) as runner:
        for i in range(4):
            assert np.array_equal(runner.generate(XS[i]), expected[i])
        with pytest.raises(WorkerCrashed):
            runner.generate(Die(XS[4], victim, str(tmp_path / "died")))
        runner.restart()
        assert np.array_equal(runner.generate(XS[4]), expected[4])
        assert np.array_equal(runner.generate(XS[5]), expected[5])
        loads = {r: len(pids_of(tmp_path, "load", r)) for r in (0, 1)}
        if mode == "kept":
            assert loads == {victim: 2, 1 - victim: 1}
        elif mode == "spare":
            assert loads == {0: 1, 1: 1} and runner.spare_takeovers == 1
        else:
            assert loads == {0: 2, 1: 2}


def test_inputs_through_shared_memory_replay_as_sent_though_the_app_reused_its_buffer(
        tmp_path):
    """The app renders every input into one buffer (a camera's frame): the journal's
    inputs stay in their segments, so the replay runs what was sent, not what the buffer
    holds now."""
    rng = np.random.default_rng(7)
    frames = [rng.random(SIZE) for _ in range(6)]
    expected = frame_reference(frames, 2)
    buffer = np.empty(SIZE)
    with make(FrameRollout, state_dir=tmp_path, snapshot_every=4) as runner:
        for i in range(3):
            buffer[:] = frames[i]
            assert np.array_equal(runner.generate(buffer), expected[i])
        buffer[:] = -1.0  # what the buffer holds now is nothing the ranks were sent
        with pytest.raises(WorkerCrashed):
            runner.generate(Die(frames[3], 1, str(tmp_path / "died")))
        runner.restart()
        assert runner.stats().replayed == 3
        for i in range(3, 6):
            buffer[:] = frames[i]
            assert np.array_equal(runner.generate(buffer), expected[i])


def test_a_reset_then_a_crash_restores_the_session_after_the_reset(tmp_path):
    expected = reference(XS, 2, reset_after=1)
    with make(state_dir=tmp_path, snapshot_every=100) as runner:
        for i in range(2):
            assert np.array_equal(runner.generate(XS[i]), expected[i])
        runner.reset()
        assert np.array_equal(runner.generate(XS[2]), expected[2])
        with pytest.raises(WorkerCrashed):
            runner.generate(Die(XS[3], 0, str(tmp_path / "died")))
        runner.restart()
        assert np.array_equal(runner.generate(XS[3]), expected[3])
        assert runner.stats().replayed == 1  # the call after the reset's snapshot


def test_a_model_with_unseeded_noise_is_reported_by_the_replay(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="reactor_dist")
    with make(Noisy, state_dir=tmp_path, snapshot_every=10) as runner:
        runner.generate(1.0)  # call 2 (call 1: the snapshot at start())
        with pytest.raises(WorkerCrashed):
            runner.generate(Die(2.0, 1, str(tmp_path / "died")))
        runner.restart()
        assert runner.stats().replay_differences == 1
    [warning] = [r for r in caplog.records if "not deterministic" in r.getMessage()]
    assert warning.getMessage().startswith(
        "the replay of generate() (call 2) after the restart gave rank 0 another result "
        "than the first run: the model is not deterministic")
    assert warning.call == 2


# -- retry_failed: the application never sees the fault -------------------------------------
def test_retry_failed_a_loop_gets_every_result_of_an_uninterrupted_run(tmp_path):
    expected = reference(XS, 2)
    with make(state_dir=tmp_path, max_restarts=1, retry_failed=True) as runner:
        got = [runner.generate(Die(x, 1, str(tmp_path / "died")) if i == 4 else x)
               for i, x in enumerate(XS)]
        assert all(np.array_equal(g, e) for g, e in zip(got, expected, strict=True))
        stats = runner.stats()
        assert (runner.restarts, stats.retried, stats.replayed) == (1, 1, 1)


def test_retry_failed_with_calls_in_flight_settles_every_future_with_its_result(tmp_path):
    expected = reference(XS, 2)
    with make(state_dir=tmp_path, max_restarts=1, retry_failed=True, max_in_flight=3,
              snapshot_every=2) as runner:
        futures = [runner.submit(Die(x, 0, str(tmp_path / "died")) if i == 3 else x)
                   for i, x in enumerate(XS)]
        got = [f.result(timeout=120) for f in futures]
        assert all(np.array_equal(g, e) for g, e in zip(got, expected, strict=True))
        assert runner.restarts == 1
        # The call that died and those in flight behind it (as far as the submits got).
        assert runner.stats().retried in (1, 2, 3)


def test_retry_failed_a_stream_hands_over_only_the_items_not_yet_handed_over(tmp_path):
    """Rank 1 dies after rank 0 yielded the step's first item, which the caller has: the
    retried stream brings the other two, nothing twice, and the next call continues the
    uninterrupted rollout."""
    expected = reference(XS, 2)
    with make(Streaming, state_dir=tmp_path, max_restarts=1, retry_failed=True) as runner:
        before = [list(runner.stream(x)) for x in XS[:2]]
        assert [len(items) for items in before] == [3, 3]
        stream = runner.stream(Die(XS[2], 1, str(tmp_path / "died")))
        first = next(stream)
        rest = list(stream)
        assert np.array_equal(first, expected[2])
        assert len(rest) == 2
        assert all(np.array_equal(item, expected[2] + k) for k, item in enumerate(rest, 1))
        assert np.array_equal(next(iter(runner.stream(XS[3]))), expected[3])
        assert (runner.restarts, runner.stats().retried) == (1, 1)


def test_retry_failed_asyncio_gets_its_result(tmp_path):
    import asyncio

    expected = reference(XS, 2)

    async def main():
        async with make(state_dir=tmp_path, max_restarts=1, retry_failed=True) as runner:
            got = [await runner.agenerate(Die(x, 1, str(tmp_path / "died")) if i == 2 else x)
                   for i, x in enumerate(XS[:4])]
            return got, runner.restarts

    got, restarts = asyncio.run(main())
    assert restarts == 1
    assert all(np.array_equal(g, e) for g, e in zip(got, expected[:4], strict=True))


# -- shared memory ----------------------------------------------------------------------------
def test_snapshot_segments_are_reused_and_a_dead_ranks_go_after_a_restart(tmp_path):
    """Per rank: the snapshot held, the one before it (its release on the way while the
    next is in flight) and the next; a dead rank's pool goes at the restart, the
    snapshot of it at the next snapshot; nothing at shutdown (conftest checks)."""
    with make(state_dir=tmp_path, snapshot_every=1) as runner:
        prefix = Probe(runner).shm_prefix

        def pool(rank: int) -> set[str]:
            return {n for n in our_shm_entries()
                    if n.startswith(f"{prefix}.{snapshot_tag(rank)}")}

        for x in XS[:6]:
            runner.generate(x)
        runner.wait_idle()
        assert runner.stats().snapshots == 7  # start() and one after each call
        assert [1 <= len(pool(r)) <= 3 for r in (0, 1)] == [True, True]
        dead = pool(1)
        with pytest.raises(WorkerCrashed):
            runner.generate(Die(XS[6], 1, str(tmp_path / "died")))
        runner.restart()
        assert len(pool(1)) == 1 and pool(1) <= dead  # the snapshot restored from
        runner.generate(XS[6])
        runner.wait_idle()
        assert not pool(1) & dead
        assert [1 <= len(pool(r)) <= 3 for r in (0, 1)] == [True, True]


# -- hooks that fail ----------------------------------------------------------------------------
def test_a_snapshot_that_raises_at_start_fails_start_and_leaves_nothing():
    runner = DistributedRunner(
        SnapshotRaises, world_size=2, device="cpu", snapshot_every=2, call_timeout=30.0,
        load_kwargs={"at": 1})
    with pytest.raises(RuntimeError, match=r"snapshot_every=2: snapshot\(\) did not return on "
                                           r"every rank at start\(\) \(rank 0 raised OSError: "
                                           r"snapshot 1 failed\); fix snapshot\(\), or pass "
                                           r"snapshot_every=0"):
        runner.start()
    assert runner.closed


def test_a_snapshot_that_raises_later_keeps_the_one_before_and_says_so(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="reactor_dist")
    expected = reference(XS, 2)
    with DistributedRunner(SnapshotRaises, world_size=2, device="cpu", snapshot_every=2,
                           call_timeout=30.0, shutdown_grace=1.0,
                           load_kwargs={"state_dir": str(tmp_path), "at": 2}) as runner:
        for i in range(3):  # the snapshot after call 2 (the 2nd) raises on every rank
            assert np.array_equal(runner.generate(XS[i]), expected[i])
        with pytest.raises(WorkerCrashed):
            runner.generate(Die(XS[3], 1, str(tmp_path / "died")))
        runner.restart()
        assert np.array_equal(runner.generate(XS[3]), expected[3])
        assert runner.stats().replayed == 3  # from the snapshot at start()
    assert any(r.getMessage().startswith("snapshot() raised on rank 0, 1 (OSError: snapshot "
                                         "2 failed): the session goes on from the snapshot "
                                         "before it (call 1)") for r in caplog.records)


def test_a_restore_that_raises_is_a_failed_restart(tmp_path):
    with make(RestoreRaises, state_dir=tmp_path) as runner:
        runner.generate(1.0)
        with pytest.raises(WorkerCrashed):
            runner.generate(Die(2.0, 1, str(tmp_path / "died")))
        with pytest.raises(OSError, match=r"restore failed \(in restore\(\) after the "
                                          r"restart\)"):
            runner.restart()
        assert not runner.healthy
        with pytest.raises(RuntimeError, match="unusable"):
            runner.generate(1.0)


def test_a_retried_call_that_fails_again_raises_and_the_budget_bounds_it(tmp_path):
    with make(Dies, state_dir=tmp_path, max_restarts=2, retry_failed=True) as runner:
        runner.generate(1.0)
        with pytest.raises(WorkerCrashed, match=r"(?s)rank 1 died during generate\(\) \(call \d+\)"
                                                r".*the runner is restarting \(restart 2 of "
                                                r"max_restarts=2 within 600 s\): the next "
                                                r"call waits for it; this call was sent again "
                                                r"once already: retry_failed sends a call "
                                                r"once$"):
            runner.generate(DieAlways(1))
        runner.wait_idle(timeout=120)  # the second restart, by itself
        assert runner.restarts == 2 and runner.stats().retried == 1
        assert np.array_equal(runner.generate(XS[1]), reference(XS, 2)[1])


def test_a_failed_automatic_restart_settles_the_futures_waiting_to_be_sent_again(tmp_path):
    """retry_failed, and the restart fails (restore() raises): the submitted call's future
    gets its error, saying so, instead of waiting for ever."""
    with make(RestoreRaises, state_dir=tmp_path, max_restarts=1, retry_failed=True) as runner:
        runner.generate(1.0)
        future = runner.submit(Die(2.0, 1, str(tmp_path / "died")))
        with pytest.raises(WorkerCrashed, match=r"(?s)this call is sent again after it "
                                                r"\(retry_failed\); the runner restarted to "
                                                r"send this call again, and the restart "
                                                r"failed: OSError: restore failed"):
            future.result(timeout=120)
        assert not runner.healthy
