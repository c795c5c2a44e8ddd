"""The first contact with GPUs (``make gpu-check`` runs these; skipped without CUDA).

They run at ``REACTOR_DIST_GPU_WORLD_SIZE`` ranks (gpu_check sets it to the GPUs it
found; default: every visible GPU), one GPU each, with the group (NCCL for CUDA tensors,
gloo for CPU ones)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from gpu_workers import FRAME, OnGpu

from reactor_dist import DistributedRunner

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def gpu_world_size() -> int:
    return int(os.environ.get("REACTOR_DIST_GPU_WORLD_SIZE") or torch.cuda.device_count())


def runner(**kw) -> DistributedRunner:
    return DistributedRunner(OnGpu, world_size=kw.pop("world_size", gpu_world_size()),
                             device="cuda", call_timeout=120.0, **kw)


def test_every_rank_on_its_gpu_with_nccl_formed_in_start_and_collectives_on_both_devices():
    n = gpu_world_size()
    with runner() as r:
        if n > 1:
            assert r.generate("formed") == ("cuda:0", True)
            assert r.generate("devices") == list(range(n))
            assert r.generate("cpu_all_gather") == [float(i) for i in range(n)]


def test_shared_empty_filled_from_the_device_is_page_locked_and_arrives_whole():
    with runner() as r:
        out = r.generate("frame")
        assert out.shape == (FRAME,) and int(out.sum()) == 7 * FRAME
        del out
        assert r.generate("frame_pinned") is True


def test_a_cuda_tensor_of_rank_0_arrives_on_the_cpu():
    with runner() as r:
        got = r.generate("cuda_tensor")
    assert isinstance(got, torch.Tensor) and got.device.type == "cpu"
    assert got.tolist() == [0, 1, 2, 3, 4, 5]


def test_a_rank_with_gpu_work_queued_is_the_slowest_not_rank_0():
    n = gpu_world_size()
    if n < 2:
        pytest.skip("needs 2 GPUs")
    with runner(load_kwargs={"slow": n - 1, "spin_cycles": 500_000_000}) as r:
        for _ in range(3):
            assert r.generate("slow") == 4.0
            assert r.last_timings.slowest_rank == n - 1


def test_doctor_passes_on_the_gpus():
    n = gpu_world_size()
    out = subprocess.run([sys.executable, "-m", "reactor_dist", "doctor", "--device", "cuda",
                          "--world-size", str(n)], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.splitlines()[0] == f"reactor-dist doctor: world_size={n}, device=cuda"


def test_more_ranks_than_gpus_is_a_clear_error():
    ranks = torch.cuda.device_count() + 1
    with pytest.raises(RuntimeError, match=f"only {ranks - 1} are visible"):
        runner(world_size=ranks, init_process_group=False).start()
