"""A rank whose CUDA context broke is lost (issue 54): every later CUDA call of its
process would fail, so the call fails with CudaContextBroken and the restart replaces
that process (with a spare where one waits) while the others keep theirs.  On CPU ranks
the worker raises what torch raises on a GPU (``torch.AcceleratorError`` with CUDA's
text); tests/test_gpu.py makes the real error with a kernel.  Shown by pids, never by
timing."""

from __future__ import annotations

import pytest
import torch
from conftest import wait_gone
from restart_workers import Alone, BreakContext, Pid, ReducesAndRejoins, SpareAware
from test_restart import make_runner
from test_spares import spare_pids, wait_for
from test_survivors_kept import reduced

from reactor_dist import CudaContextBroken, WorkerCrashed
from reactor_dist.device import context_broken

ILLEGAL = "CUDA error: an illegal memory access was encountered"


def test_the_sticky_cuda_errors_are_told_from_the_others():
    assert context_broken(torch.AcceleratorError(ILLEGAL), "cpu")
    assert context_broken(RuntimeError("CUDA error: device-side assert triggered"), "cuda:0")
    try:  # the model's own error, raised from torch's
        try:
            raise torch.AcceleratorError("CUDA error: unspecified launch failure")
        except torch.AcceleratorError as inner:
            raise ValueError("the step failed") from inner
    except ValueError as outer:
        assert context_broken(outer, "cpu")
    # Errors that leave the context usable: a bad argument, running out of memory, text
    # that merely mentions an illegal access.
    assert not context_broken(torch.AcceleratorError("CUDA error: invalid argument"), "cpu")
    assert not context_broken(torch.OutOfMemoryError("CUDA out of memory."), "cuda:0")
    assert not context_broken(ValueError("an illegal memory access was encountered"), "cpu")


def test_the_rank_is_replaced_by_restart_and_the_others_keep_their_process(tmp_path):
    runner = make_runner(3, ReducesAndRejoins, load_kwargs={"state_dir": str(tmp_path)})
    with runner:
        pids = [pid for pid, _, _ in runner.generate(Pid())]
        with pytest.raises(CudaContextBroken) as caught:
            runner.generate(BreakContext((1,)))
        error = caught.value
        assert isinstance(error, WorkerCrashed)
        assert str(error).startswith(
            f"the CUDA context of rank 1 is broken in generate() (rank 1: torch.AcceleratorError: "
            f"{ILLEGAL}): every later CUDA call of that process would fail, so the restart "
            f"replaces it (with a spare where one waits) and the other ranks keep theirs; "
            f"the runner is unusable")
        assert type(error.__cause__) is torch.AcceleratorError
        assert [(f.rank, f.pid, f.alive) for f in error.failures] == [(1, pids[1], True)]
        assert not runner.healthy
        runner.restart()
        after = runner.generate(Pid())
        assert after[0] == (pids[0], 1, 1) and after[2] == (pids[2], 1, 1)
        assert after[1][0] != pids[1] and after[1][1:] == (1, 0)
        assert wait_gone([pids[1]]) == []
        assert runner.generate(2.0) == reduced(3, 2.0)
    assert wait_gone(pids + [after[1][0]]) == []


def test_every_rank_broken_is_every_rank_replaced(tmp_path):
    """Every rank raised the same error: without a broken context that is an ordinary
    exception (healthy); with one, every process is replaced."""
    runner = make_runner(2, ReducesAndRejoins, load_kwargs={"state_dir": str(tmp_path)})
    with runner:
        pids = [pid for pid, _, _ in runner.generate(Pid())]
        with pytest.raises(torch.AcceleratorError, match="CUDA error: invalid argument"):
            runner.generate(BreakContext((0, 1), "CUDA error: invalid argument"))
        assert runner.healthy
        with pytest.raises(CudaContextBroken, match=r"the CUDA context of ranks 0, 1 is "
                                                    r"broken in generate\(\) \(rank 0: "):
            runner.generate(BreakContext((0, 1), wrapped=True))
        runner.restart()
        after = runner.generate(Pid())
        assert [a[1:] for a in after] == [(1, 0), (1, 0)]
        assert not set(pids) & {pid for pid, _, _ in after}
    assert wait_gone(pids + [pid for pid, _, _ in after]) == []


def test_a_spare_takes_the_broken_ranks_place_in_the_automatic_restart(tmp_path):
    runner = make_runner(2, SpareAware, spares=1, max_restarts=1,
                         load_kwargs={"state_dir": str(tmp_path)})
    with runner:
        pids = [pid for pid, _, _ in runner.generate(Pid())]
        [spare] = spare_pids(tmp_path)
        with pytest.raises(CudaContextBroken, match="the runner is restarting"):
            runner.generate(BreakContext((0,)))
        assert runner.generate(Pid(), timeout=120) == [(spare, 1, 1), (pids[1], 1, 1)]
        assert runner.generate(3.0) == reduced(2, 3.0)
        assert runner.restarts == 1 and runner.spare_takeovers == 1
        assert wait_gone([pids[0]]) == []
        assert wait_for(lambda: runner.spares_ready == 1)
    assert wait_gone(pids + spare_pids(tmp_path)) == []


def test_at_world_size_1_the_call_after_the_restart_succeeds():
    runner = make_runner(1, Alone)
    with runner:
        pid, _ = runner.generate(0)
        with pytest.raises(CudaContextBroken, match="the CUDA context of rank 0 is broken"):
            runner.generate(BreakContext((0,), wrapped=True))
        with pytest.raises(RuntimeError, match="unusable: CudaContextBroken"):
            runner.generate(1)
        runner.restart()
        again, value = runner.generate(2)
        assert (value, again != pid) == (2, True)
        assert wait_gone([pid]) == []
    assert wait_gone([pid, again]) == []
