"""Real third-party parallel models in the ranks (issue 33): transformers' own tensor
parallelism (a tiny Llama) and diffusers' own context parallelism (a tiny Wan
transformer, Ulysses), each at world_size 2 against world_size 1 in this process, each
rank holding its half, and each through a real fault and ``restart()`` with
``rejoin()``.  Nothing is downloaded: tiny configs, seeded random weights.  Slow (each
runner imports transformers or diffusers: ~5 s to start on two cores): make test-slow."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from reactor_dist import DistributedRunner, WorkerCrashed
from workers.hf_llama import LlamaTP, load_llama, logits, save_tiny_llama
from workers.wan_context import WanContextParallel, build_wan, predict

pytestmark = pytest.mark.slow
TOLERANCE = 1e-5


def kill_and_restart(runner: DistributedRunner, rank: int) -> None:
    os.kill(runner.ranks[rank].pid, signal.SIGKILL)
    with pytest.raises(WorkerCrashed):
        runner.generate(1)  # noticed (a rank died while idle)
    runner.restart()


def test_transformers_tensor_parallel_llama_matches_world_size_1_and_survives_a_fault(
        tmp_path):
    path = save_tiny_llama(str(tmp_path / "llama"), seed=0)
    ids = list(range(3, 35))
    expected = logits(load_llama(path, None, "cpu"), ids, "cpu")
    with DistributedRunner(LlamaTP, world_size=2, device="cpu", load_kwargs={"path": path},
                           start_timeout=300, shutdown_grace=1.0) as runner:
        got = runner.generate(ids)
        assert got.shape == (32, 256)
        assert float(np.abs(got - expected).max()) <= TOLERANCE
        assert runner.generate("shards") == [(32, 64), (32, 64)]  # half of q_proj each
        survivor = runner.ranks[0].pid
        kill_and_restart(runner, 1)
        assert runner.ranks[0].pid == survivor  # kept its process: rejoin() resharded
        assert float(np.abs(runner.generate(ids) - expected).max()) <= TOLERANCE
        assert runner.generate("shards") == [(32, 64), (32, 64)]


def test_diffusers_context_parallel_wan_matches_world_size_1_and_survives_a_fault():
    expected = predict(build_wan(0), 3, "cpu")
    with DistributedRunner(WanContextParallel, world_size=2, device="cpu",
                           start_timeout=300, shutdown_grace=1.0) as runner:
        got = runner.generate(3)
        assert got.shape == (1, 4, 2, 16, 16)
        assert float(np.abs(got - expected).max()) <= TOLERANCE
        assert runner.generate(-3) == [64, 64]  # half of the 128 tokens each
        survivor = runner.ranks[1].pid
        kill_and_restart(runner, 0)
        assert runner.ranks[1].pid == survivor
        assert float(np.abs(runner.generate(3) - expected).max()) <= TOLERANCE
        assert runner.generate(-3) == [64, 64]
