"""Device binding: which device each rank gets, and the errors when the asked-for device
is missing. The GPU-marked tests run where CUDA is visible."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sample_workers import AllGather, Echo, ReportEnvironment, SharedArray

from reactor_dist import DistributedRunner

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine's error")
def test_asking_for_cuda_without_a_gpu_fails_start_clearly():
    runner = DistributedRunner(Echo, world_size=1, device="cuda",
                               init_process_group=False)
    with pytest.raises(RuntimeError, match="device='cuda' was asked for, but torch sees no CUDA"):
        runner.start()
    assert not runner.healthy


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU fallback only happens without CUDA")
def test_auto_falls_back_to_cpu_and_gloo():
    with DistributedRunner(Echo, world_size=2) as runner:
        assert runner.generate(ReportEnvironment())["device"] == "cpu"
        np.testing.assert_array_equal(runner.generate(AllGather()), [1, 1, 2, 2])


@pytest.mark.gpu
@needs_cuda
def test_cuda_rank_is_bound_to_its_gpu():
    with DistributedRunner(Echo, world_size=1, device="cuda") as runner:
        assert runner.generate(ReportEnvironment())["device"] == "cuda:0"
        out = runner.generate(SharedArray((1 << 20,), fill=5))
        assert int(out.sum()) == 5 << 20


@pytest.mark.gpu
@needs_cuda
def test_more_ranks_than_gpus_is_a_clear_error():
    ranks = torch.cuda.device_count() + 1
    runner = DistributedRunner(Echo, world_size=ranks, device="cuda",
                               init_process_group=False)
    with pytest.raises(RuntimeError, match=f"only {ranks - 1} are visible"):
        runner.start()
