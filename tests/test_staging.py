"""Device tensors straight into registered result segments, and inputs to the device from
registered mappings (staging.py), run on the CPU through the same functions: the test
hook REACTOR_DIST_STAGE_CPU=1 makes a rank stage its CPU tensors as a CUDA rank stages
its CUDA ones (a plain copy where the GPU's would be a non_blocking one on a stream).
The CUDA calls themselves are checked by tests/test_gpu.py on a GPU, and the
registration's bookkeeping by tests/test_host_pinning.py with a stand-in CUDA runtime."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from conftest import our_shm_entries, segment_of, wait_gone
from probe import Probe
from staging_workers import MB, Inputs, Staged, made

from reactor_dist import DistributedRunner
from reactor_dist.rank.staging import STAGE_CPU_ENV, STAGE_FROM, InputStaging

HOOK = {STAGE_CPU_ENV: "1"}


@pytest.fixture(scope="module")
def staged2():
    """A 2-rank runner whose rank 0 stages its CPU tensors."""
    with DistributedRunner(Staged, world_size=2, init_process_group=False, device="cpu",
                           env=HOOK) as runner:
        yield runner


@pytest.fixture(autouse=True)
def nothing_left_behind():
    """Overrides conftest's: the module runner lives across tests; checked at module end
    by test_nothing_is_left_behind."""
    yield


def in_results(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` views a segment of rank 0's result pool: zero-copy."""
    name = segment_of(tensor.data_ptr())
    return name is not None and ".r0-" in name


def unpacked(how: str, kinds: list[str], out):
    if how == "bare":
        return [out]
    if how == "dataclass":
        assert out.note == "frames"
        return [out.frames]
    if how == "dict":
        assert list(out) == kinds
        return [out[kind] for kind in kinds]
    return list(out)


@pytest.mark.parametrize("how,kinds", [
    ("bare", ["uint8"]), ("dataclass", ["uint8"]), ("dataclass", ["bfloat16"]),
    ("dict", ["float8", "bool", "bfloat16"]), ("list", ["transposed", "uint8"]),
])
def test_each_kind_of_result_arrives_as_the_same_tensor_over_shared_memory(
        staged2, how, kinds):
    for step in range(3):  # the segments are reused from the second call on
        before = staged2.generate(("staged", [], 0))
        got = unpacked(how, kinds, staged2.generate((how, kinds, step)))
        assert staged2.generate(("staged", [], 0)) == before + len(kinds)
        for tensor, kind in zip(got, kinds, strict=True):
            want = made(kind, step)
            assert type(tensor) is torch.Tensor and tensor.device.type == "cpu"
            assert tensor.dtype == want.dtype and tensor.shape == want.shape
            assert tensor.is_contiguous() and in_results(tensor)
            assert torch.equal(tensor, want.contiguous())


def test_a_conjugate_or_negative_view_is_made_plain_before_its_copy(staged2):
    """Issue 54: on a GPU the async copy would apply the view's bit to the target before
    the bytes land; the staged result holds the view's values, the bit resolved."""
    before = staged2.generate(("resolved", [], 0))
    got = staged2.generate(("list", ["conj", "neg"], 4))
    assert staged2.generate(("resolved", [], 0)) == before + 2
    for tensor, kind in zip(got, ["conj", "neg"], strict=True):
        want = made(kind, 4)
        assert not tensor.is_conj() and not tensor.is_neg() and in_results(tensor)
        assert torch.equal(tensor, want.resolve_conj().resolve_neg())


def test_each_item_of_a_stream_is_staged(staged2):
    kinds = ["uint8", "bfloat16", "transposed"]
    for step in range(2):
        before = staged2.generate(("staged", [], 0))
        items = list(staged2.stream(("stream", kinds, step)))
        assert staged2.generate(("staged", [], 0)) == before + 3
        assert [(t.dtype, tuple(t.shape)) for t in items] == [
            (made(k, step).dtype, tuple(made(k, step).shape)) for k in kinds]
        assert all(torch.equal(t, made(k, step)) and in_results(t)
                   for t, k in zip(items, kinds, strict=True))


def test_a_small_tensor_stays_on_the_old_path(staged2):
    small = made("small", 0)
    assert small.nbytes < STAGE_FROM
    before = staged2.generate(("staged", [], 0))
    got = staged2.generate(("bare", ["small"], 0))
    assert staged2.generate(("staged", [], 0)) == before
    assert torch.equal(got, small) and not in_results(got)  # an in-band frame


def test_a_cpu_rank_without_the_hook_stages_nothing():
    with DistributedRunner(Staged, world_size=1, device="cpu") as runner:
        got = runner.generate(("bare", ["uint8"], 1))
        assert torch.equal(got, made("uint8", 1)) and in_results(got)  # copied there
        assert runner.generate(("staged", [], 0)) == 0


def test_numpy_made_from_a_tensor_is_told_once_how_to_do_better(caplog):
    caplog.set_level(logging.INFO, logger="reactor_dist")
    with DistributedRunner(Staged, world_size=1, device="cpu", env=HOOK) as runner:
        for step in range(3):
            out = runner.generate(("numpy", [], step))
            assert out.shape == (9 * MB,) and (out == step).all()
    hints = [r.getMessage() for r in caplog.records if "numpy array made from" in
             r.getMessage()]
    assert hints == [
        "reactor_dist: rank 0 returned a 9.4 MB numpy array made from a torch tensor "
        "(.cpu().numpy()): return the CUDA tensor itself instead (bare or inside your "
        "result) and reactor_dist copies it straight into page-locked shared memory, the "
        "caller getting a CPU tensor (its .numpy() is free); on an H200 that is ~0.2 ms a "
        "call instead of ~9 ms (docs: Performance, frames from the GPU)"]


@pytest.mark.parametrize("world_size", [1, 2])
def test_to_device_copies_an_input_from_its_registered_mapping(world_size):
    x = np.arange(STAGE_FROM, dtype=np.int32)  # 4 MiB: through shared memory
    with DistributedRunner(Inputs, world_size=world_size, init_process_group=False,
                           device="cpu", env=HOOK) as runner:
        fast = []
        for write in (None, None, np.array([-1, -2], np.int32), None):
            copied, count, rank = runner.generate((x, write))
            head = x[:2] if write is None else write  # a write of the worker is seen
            assert rank == 0 and np.array_equal(copied[:2], head)
            assert np.array_equal(copied[2:], x[2:])
            fast.append(count)
        assert fast == [1, 2, 2, 3]  # the written array took the ordinary copy
        tensor = torch.arange(STAGE_FROM, dtype=torch.float64)  # a tensor input too
        copied, count, _ = runner.generate((tensor, None))
        assert np.array_equal(copied, tensor.numpy()) and count == 4
        small = np.arange(1000, dtype=np.int64)  # in-band: no segment, no mapping
        copied, count, _ = runner.generate((small, None))
        assert np.array_equal(copied, small) and count == 4


def test_to_device_outside_a_rank_is_the_plain_copy():
    worker = Inputs()
    x = np.arange(10, dtype=np.float32)
    assert torch.equal(worker.to_device(x), torch.from_numpy(x))
    staging = InputStaging("/dev/shm", dict, None, lambda: "cpu")
    with pytest.raises(TypeError) as err:
        staging.to_device([1, 2])
    assert str(err.value) == "to_device() takes a numpy array or a torch tensor, not a list"


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2G"])
def test_pinned_limit_is_an_int_of_bytes(bad):
    with pytest.raises(ValueError) as err:
        DistributedRunner(Staged, world_size=1, device="cpu", pinned_limit=bad)
    assert str(err.value) == (
        f"pinned_limit must be an int >= 0 (bytes of shared memory a CUDA rank keeps "
        f"page-locked; 0: none), got {bad!r}")


def test_nothing_is_left_behind(staged2):
    """Last of the module: the module runner's results come and go, and after its
    shutdown nothing of it is left."""
    for step in range(3):
        assert torch.equal(staged2.generate(("bare", ["uint8"], step)), made("uint8", step))
    pids = Probe(staged2).rank_pids
    staged2.shutdown()
    assert wait_gone(pids) == []
    assert our_shm_entries() == set()
