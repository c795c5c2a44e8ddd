"""The torch.distributed group a rank forms: its timeouts and its backends."""

from __future__ import annotations

import pytest
import torch
from group_workers import GroupProbe

from reactor_dist import DistributedRunner
from reactor_dist.rank.group import group_options
from reactor_dist.timeouts import GROUP_MARGIN, GROUP_WITHOUT_CALL_TIMEOUT, LIBRARY_CAP


@pytest.mark.parametrize("call_timeout, want", [
    (5.0, 5.0 + GROUP_MARGIN),
    (7200.0, 7200.0 + GROUP_MARGIN),
    (None, GROUP_WITHOUT_CALL_TIMEOUT),
    (1e30, LIBRARY_CAP),
])
def test_the_group_timeout_follows_call_timeout_once_loaded(call_timeout, want):
    # During start() (formation, load()) the group waits as long as start_timeout; its
    # calls' collectives then wait call_timeout plus a margin, not start_timeout.
    with DistributedRunner(GroupProbe, world_size=2, device="cpu", call_timeout=call_timeout,
                           start_timeout=900.0) as runner:
        every = runner.generate(None, timeout=60.0)
    assert [r["load_timeout"] for r in every] == [900.0, 900.0]
    assert [r["timeout"] for r in every] == [want, want]


def test_a_cuda_rank_gets_a_backend_per_device_and_a_cpu_rank_gloo():
    # nccl alone serves CUDA tensors only: a CPU-side collective on a GPU rank needs gloo.
    assert group_options("cuda:3")["backend"] == "cpu:gloo,cuda:nccl"
    assert group_options("cuda:0")["backend"] == "cpu:gloo,cuda:nccl"
    assert group_options("cpu")["backend"] == "gloo"


def test_a_cuda_rank_binds_its_gpu_so_nccl_forms_during_start_and_a_cpu_rank_nothing():
    assert group_options("cuda:3") == {"backend": "cpu:gloo,cuda:nccl",
                                       "device_id": torch.device("cuda", 3)}
    assert group_options("cuda:0")["device_id"] == torch.device("cuda", 0)
    assert group_options("cpu") == {"backend": "gloo"}  # no device_id on CPU


def test_a_cpu_group_is_gloo_and_gathers():
    with DistributedRunner(GroupProbe, world_size=2, device="cpu") as runner:
        every = runner.generate(None)  # all_gather_object over the group
    assert [r["backend"] for r in every] == ["gloo", "gloo"]
