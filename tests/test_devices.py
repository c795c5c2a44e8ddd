"""Device binding: which device each rank gets, and the errors when the asked-for device
is missing. The GPU-marked tests are in test_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sample_workers import AllGather, Echo, ReportEnvironment

from reactor_dist import DistributedRunner


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
