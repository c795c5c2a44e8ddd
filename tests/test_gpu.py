"""The first contact with GPUs (``make gpu-check`` runs these; skipped without CUDA).

They run at ``REACTOR_DIST_GPU_WORLD_SIZE`` ranks (gpu_check sets it to the GPUs it
found; default: every visible GPU), one GPU each, with the group (NCCL for CUDA tensors,
gloo for CPU ones)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from gpu_workers import FRAME, KINDS, Held, OnGpu, StreamsTensors, Tensors, made
from timing_workers import SlowBeforeAllReduce

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


def same(got, expected: torch.Tensor) -> None:
    """``got`` is a CPU tensor of ``expected``'s dtype and shape, equal to it bit for bit
    (float8 has no CPU equality: compared as its bytes)."""
    assert isinstance(got, torch.Tensor) and got.device.type == "cpu"
    assert (got.dtype, got.shape) == (expected.dtype, expected.shape)
    expected = expected.cpu()
    if expected.dtype == torch.float8_e4m3fn:
        got, expected = got.view(torch.uint8), expected.view(torch.uint8)
    assert torch.equal(got, expected)


def arrived(got, kind: str) -> None:
    """``got`` is rank 0's ``made(kind)``, on the CPU."""
    expected = made(kind, "cuda")
    if kind == "dataclass":
        assert isinstance(got, Held)
        got, expected = got.frames, expected.frames
    same(got, expected)


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_of_cuda_tensor_in_rank_0s_result_arrives_as_an_equal_cpu_tensor(kind):
    # bare uint8, in a dataclass, bf16, float8, bool, a transposed view (non-contiguous),
    # and one under staging's threshold; twice each: the second from a warm segment
    with DistributedRunner(Tensors, world_size=gpu_world_size(), device="cuda",
                           call_timeout=120.0) as r:
        for _ in range(2):
            arrived(r.generate(kind), kind)


def test_the_same_tensors_yielded_by_a_stream_arrive_as_equal_cpu_tensors():
    with DistributedRunner(StreamsTensors, world_size=gpu_world_size(), device="cuda",
                           call_timeout=120.0) as r:
        items = list(r.stream(list(KINDS)))
        assert len(items) == len(KINDS)
        for got, kind in zip(items, KINDS, strict=True):
            arrived(got, kind)


def test_an_input_array_reaches_the_gpu_with_to_device_equal_to_a_plain_copy():
    # 8 MB: it travels through shared memory; twice: the second from a warm mapping
    x = (np.arange(8 << 20) % 253).astype(np.uint8).reshape(8, 1024, 1024)
    with DistributedRunner(Tensors, world_size=gpu_world_size(), device="cuda",
                           call_timeout=120.0) as r:
        for _ in range(2):
            on_gpu, equal, device = r.generate(x)
            assert (equal, device) == (True, "cuda:0")
            same(on_gpu, torch.from_numpy(x).cuda())


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


def stragglers(caplog) -> list:
    return [r for r in caplog.records if r.name == "reactor_dist" and "straggler" in r.message]


@pytest.mark.parametrize("where", ["host", "device"])
def test_a_rank_slow_before_an_all_reduce_is_named_on_cuda(caplog, where):
    # The CPU test's case (tests/test_timings.py) over NCCL: rank n-1 is 20 ms late to an
    # all_reduce of CUDA tensors, by sleeping on the host or by GPU work queued before it
    # (then every host launches at once: only the device timeline sees the wait).
    n = gpu_world_size()
    if n < 2:
        pytest.skip("needs 2 GPUs")
    caplog.set_level(logging.WARNING, logger="reactor_dist")
    slow = {"host": {"extra": 0.02}, "device": {"extra": 0.0, "spin_cycles": 40_000_000}}
    with DistributedRunner(SlowBeforeAllReduce, world_size=n, device="cuda",
                           call_timeout=120.0, load_kwargs={"slow": n - 1, **slow[where]}) as r:
        for i in range(40):
            assert r.generate(i) == 4.0 * n + i
        t = r.last_timings
        assert t.slowest_rank == n - 1
        # wall-clock: orders: the last rank is 20 ms (or a kernel) late to the all_reduce,
        # rank 0 waits for it; a skew that long between the ranks would turn them round
        assert t.collective_wait[0] > t.collective_wait[n - 1]
        assert r.stats().busy[n - 1].p50 > r.stats().busy[0].p50  # wall-clock: an order, as above
    (record,) = stragglers(caplog)
    assert record.getMessage().startswith(f"rank {n - 1} is a straggler")


def test_a_balanced_run_on_cuda_warns_of_no_straggler(caplog):
    n = gpu_world_size()
    if n < 2:
        pytest.skip("needs 2 GPUs")
    caplog.set_level(logging.WARNING, logger="reactor_dist")
    with DistributedRunner(SlowBeforeAllReduce, world_size=n, device="cuda",
                           call_timeout=120.0,
                           load_kwargs={"slow": None, "base": 0.005}) as r:
        for i in range(40):
            assert r.generate(i) == 4.0 * n + i
        assert len(r.last_timings.collective_wait) == n
    assert stragglers(caplog) == []


DEVICE_EVENTS = """
import os, sys, torch, torch.distributed as dist
from reactor_dist.rank import collective_wait
store = dist.FileStore(sys.argv[1], 1)
dist.init_process_group("cpu:gloo,cuda:nccl", store=store, rank=0, world_size=1,
                        device_id=torch.device("cuda:0"))
waits = collective_wait.install("cuda:0")
t = torch.ones(4, device="cuda:0")
waits.begin()
dist.all_reduce(t)                          # CUDA tensor: one pair of events
dist.all_reduce(t, async_op=True).wait()    # one pair at the call, one in wait()
dist.all_gather([torch.zeros(1)], torch.ones(1))  # CPU tensors: host wall time
host = waits.host
torch.cuda.synchronize()
print(waits.used, host > 0, waits.take() > host, waits.used, t.sum().item())
waits.begin()
torch.cuda._sleep(2_000_000_000)  # about a second: the next events are not done yet
dist.all_reduce(t)
print(waits.take())               # an incomplete pair is left out, no error
torch.cuda.synchronize()
dist.destroy_process_group()
"""


def test_collectives_on_cuda_tensors_are_timed_with_device_events(tmp_path):
    # One GPU is enough: a group of one rank, in a fresh interpreter.
    out = subprocess.run([sys.executable, "-c", DEVICE_EVENTS, str(tmp_path / "store")],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.splitlines() == ["3 True True 0 4.0", "0.0"]


# The third-party parallel models (workers/hf_llama.py, workers/wan_context.py) on NCCL:
# float32 weights; on a GPU, cuDNN's convolutions (Wan's patch embedding) may use TF32,
# hence the tolerance.  One GPU: world_size 1 (NCCL allows one rank per GPU).
GPU_TOLERANCE = 5e-3


def test_transformers_tensor_parallel_llama_on_cuda_matches_the_cpu(tmp_path):
    pytest.importorskip("transformers")  # make gpu-check-here where it is not installed
    from workers.hf_llama import LlamaTP, load_llama, logits, save_tiny_llama

    path = save_tiny_llama(str(tmp_path / "llama"))
    ids = list(range(3, 35))
    expected = logits(load_llama(path, None, "cpu"), ids, "cpu")
    world_size = 2 if gpu_world_size() >= 2 else 1
    with DistributedRunner(LlamaTP, world_size=world_size, device="cuda",
                           load_kwargs={"path": path}, call_timeout=120.0) as run:
        got = run.generate(ids)
        assert float(abs(got - expected).max()) <= GPU_TOLERANCE
        assert run.generate("shards") == [(64 // world_size, 64)] * world_size


def test_diffusers_context_parallel_wan_on_cuda_matches_the_cpu():
    pytest.importorskip("transformers")  # the Wan worker imports it too
    pytest.importorskip("diffusers")
    from workers.wan_context import WanContextParallel, build_wan, predict

    expected = predict(build_wan(0), 3, "cpu")
    world_size = 2 if gpu_world_size() >= 2 else 1
    with DistributedRunner(WanContextParallel, world_size=world_size, device="cuda",
                           call_timeout=120.0) as run:
        got = run.generate(3)
        assert float(abs(got - expected).max()) <= GPU_TOLERANCE
        assert run.generate(-3) == [128 // world_size] * world_size


def three_gpus() -> None:
    if gpu_world_size() < 3:
        pytest.skip(f"needs 3 GPUs (two survivors and a victim), {gpu_world_size()} visible")


@pytest.mark.parametrize("when", ["before", "inside"])
def test_survivors_waiting_in_an_nccl_all_reduce_keep_their_process(tmp_path, when):
    """Rank 2 SIGKILLed before or inside an all_reduce of CUDA tensors: at the restart
    each survivor's NCCL communicator is aborted (group.Rendezvous.abort), the survivor
    leaves the collective and keeps its process and its one load()."""
    from restart_workers import DieIn, Pid, ReducesAndRejoins

    from reactor_dist import WorkerCrashed

    three_gpus()
    with DistributedRunner(ReducesAndRejoins, world_size=3, device="cuda", call_timeout=120.0,
                           start_timeout=300.0, shutdown_grace=5.0,
                           load_kwargs={"state_dir": str(tmp_path)}) as r:
        pids = [pid for pid, _, _ in r.generate(Pid())]
        with pytest.raises(WorkerCrashed, match="rank 2 died"):
            r.generate(DieIn(2, when, "all_reduce", 4096, on_device=True))
        r.restart()
        after = r.generate(Pid())
        assert after[:2] == [(pids[0], 1, 1), (pids[1], 1, 1)]
        assert after[2][0] != pids[2] and after[2][1:] == (1, 0)
        assert r.generate(DieIn(-1, "before", "all_reduce", 4, on_device=True)) == "returned"


def test_a_spare_on_the_third_gpu_takes_rank_1s_place_over_nccl(tmp_path):
    """world_size 2 and one spare (GPU 2): rank 1 SIGKILLed; the spare becomes rank 1 on
    its own GPU, joins the NCCL group and runs rejoin(); no load() again."""
    from restart_workers import Pid, SpareAware

    three_gpus()
    with DistributedRunner(SpareAware, world_size=2, spares=1, device="cuda",
                           call_timeout=120.0, start_timeout=300.0, shutdown_grace=5.0,
                           load_kwargs={"state_dir": str(tmp_path)}) as r:
        pids = [pid for pid, _, _ in r.generate(Pid())]
        assert r.spares_ready == 1
        os.kill(pids[1], 9)
        r.restart()
        after = r.generate(Pid())
        assert after[0] == (pids[0], 1, 1) and after[1][1:] == (1, 1)
        assert after[1][0] not in pids
        assert r.devices == ("cuda:0", "cuda:2") and r.spare_takeovers == 1


def test_a_spare_sharing_the_ranks_gpu_takes_its_place(tmp_path):
    """gpus=[0, 0], world_size 1, spares=1: the rank and the spare each hold the model on
    GPU 0 (CUDA_VISIBLE_DEVICES="0", index 0 for both: "0,0" would show CUDA no GPU);
    the rank SIGKILLed, the spare takes its place with no load() and answers exactly."""
    from gpu_workers import WeightsOnGpu

    with DistributedRunner(WeightsOnGpu, world_size=1, spares=1, gpus=[0, 0], device="cuda",
                           call_timeout=120.0, start_timeout=300.0,
                           shutdown_grace=5.0) as r:
        pid, device, current, visible, loads, rejoins = r.generate("where")
        assert (device, current, visible, loads, rejoins) == ("cuda:0", 0, "0", 1, 0)
        assert r.spares_ready == 1 and r.generate(2.0) == 1047552.0
        os.kill(pid, 9)
        r.restart()
        spare, device, current, visible, loads, rejoins = r.generate("where")
        assert spare != pid and r.spare_takeovers == 1
        assert (device, current, visible, loads, rejoins) == ("cuda:0", 0, "0", 1, 1)
        assert r.devices == ("cuda:0",)
        assert r.generate(2.0) == 1047552.0 and r.generate(0.5) == 261888.0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_a_shape_mismatch_in_an_nccl_all_reduce_is_named_from_the_rings():
    """Issue 45 on NCCL: the shapes are recorded before the work is queued, so the hang
    that NCCL makes of a mismatch is reported as that mismatch."""
    from collective_workers import Collectives

    from reactor_dist import WorkerTimeout

    with DistributedRunner(Collectives, world_size=2, device="cuda", call_timeout=10.0,
                           shutdown_grace=1.0) as r:
        assert r.generate("ok") == 16
        with pytest.raises(WorkerTimeout) as caught:
            r.generate("shape")
    assert str(caught.value).split("\n")[0] == (
        "all_reduce #1 of call 2: rank 0 has [4] float32, rank 1 has [8] float32 — the "
        "shapes differ")


def test_a_kernel_that_reads_out_of_bounds_loses_its_rank_and_restart_replaces_it():
    """Issue 54 on a GPU, at world size 1: an index kernel reads past its tensor (a
    device-side assert, sticky: every later CUDA call of that process fails); the call
    is CudaContextBroken, and after restart() a new process answers."""
    from reactor_dist import CudaContextBroken

    with runner(world_size=1) as r:
        pid = r.ranks[0].pid
        with pytest.raises(CudaContextBroken, match="the CUDA context of rank 0 is broken"):
            r.generate("out_of_bounds")
        r.restart()
        assert r.ranks[0].pid != pid
        assert r.generate("cuda_tensor").tolist() == [0, 1, 2, 3, 4, 5]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_a_hung_nccl_all_reduce_is_reported_from_nccls_recorder():
    """Issue 54: the last rank skips an all_reduce of CUDA tensors; the timeout's report
    reads NCCL's flight recorder (with gloo's, merged by time) and says so."""
    import re

    from collective_workers import Collectives

    from reactor_dist import WorkerTimeout

    with DistributedRunner(Collectives, world_size=2, device="cuda", call_timeout=10.0,
                           shutdown_grace=1.0) as r:
        r.generate("ok")
        with pytest.raises(WorkerTimeout) as caught:
            r.generate("skip")
    block = str(caught.value).split("their torch groups' flight recorders:\n", 1)[1]
    got = dict(re.findall(r"^  rank (\d+): (.*)$", block.split("\nthe silent", 1)[0], re.M))
    assert got["0"].startswith("NCCL") and "nccl:all_reduce" in got["0"], got
    assert "not finished: " in got["0"], got
