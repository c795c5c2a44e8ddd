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


def test_a_gpu_named_twice_is_visible_once_and_each_place_finds_its_index():
    """gpus=[0, 1, 0] (a spare on rank 0's GPU): every process sees "0,1" (CUDA takes
    "0,1,0" or "0,0" for no GPU at all) and picks its own GPU by index in it."""
    from reactor_dist.device import cuda_visible_devices, gpu_index, visible_gpus
    from reactor_dist.placement.local import LocalPlacement

    assert visible_gpus([0, 1, 0]) == [0, 1]
    assert cuda_visible_devices([0, 1, 0]) == "0,1"
    assert cuda_visible_devices([0, 0]) == "0"
    assert cuda_visible_devices([6, 1, 6, 3]) == "6,1,3"  # the order named, as before
    assert [gpu_index([0, 1, 0], p) for p in range(3)] == [0, 1, 0]
    assert [gpu_index([6, 1, 6, 3], p) for p in range(4)] == [0, 1, 0, 2]
    assert [gpu_index([0, 0], p) for p in range(2)] == [0, 0]
    assert [gpu_index(None, p) for p in range(3)] == [0, 1, 2]  # no gpus=: the place
    local = LocalPlacement(2, env={}, gpus=[0, 1, 0], launch_prefix=[])
    assert [local.device_index(p) for p in range(3)] == [0, 1, 0]
    assert [local.gpu_of(p) for p in range(3)] == [0, 1, 0]
    plain = LocalPlacement(2, env={}, gpus=None, launch_prefix=[])
    assert [plain.device_index(p) for p in range(3)] == [0, 1, 2]
    assert [plain.gpu_of(p) for p in range(3)] == [0, 1, 2]
