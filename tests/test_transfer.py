"""Payloads through shared memory: every dtype and layout, zero copy, no leak, and a clear
error when /dev/shm is too small."""

from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
from conftest import our_shm_entries, segment_of
from probe import Probe
from sample_workers import Echo, FullArray, MetaTensor, SharedArray, WriteInput

from reactor_dist import DistributedRunner, SharedMemoryExhausted, WorkerCrashed
from reactor_dist.shm import segments
from reactor_dist.wire.transfer import INLINE_LIMIT, dumps, on_cpu

BIG = 4 * INLINE_LIMIT  # surely out of band, through a segment


@pytest.fixture(scope="module")
def echo2():
    """One 2-rank runner for the many round trips (each test checks its own results)."""
    runner = DistributedRunner(Echo, world_size=2, init_process_group=False,
                               device="cpu")
    runner.start()
    yield runner
    runner.shutdown()


@pytest.fixture(autouse=True)
def nothing_left_behind():
    """Overrides conftest's: the module runner lives across tests; checked at module end."""
    yield


ALL_DTYPES = [np.dtype(c) for c in "?bBhHiIlLqQefdgFDG"] + [
    np.dtype("M8[ns]"), np.dtype("m8[s]"), np.dtype("U7"), np.dtype("S5"), np.dtype("V16"),
    np.dtype([("x", "<f4"), ("n", "<i8"), ("tag", "S3")]), np.dtype(">i4"), np.dtype("<u2")]


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("count", [3, BIG])
def test_every_dtype_round_trips(echo2, dtype, count):
    raw = np.random.default_rng(count).integers(0, 255, count * dtype.itemsize, dtype=np.uint8)
    if dtype.kind in "fcM":
        raw[:] = 1  # avoid NaN payloads (NaN != NaN), keep bit patterns meaningful
    array = raw.view(dtype)
    out = echo2.generate(array)
    assert out.dtype == dtype and out.shape == array.shape
    assert out.tobytes() == array.tobytes()


def test_object_arrays_round_trip_in_band(echo2):
    array = np.array([{"a": 1}, "two", None], dtype=object)
    out = echo2.generate(array)
    assert out.dtype == object and list(out) == list(array)


@pytest.mark.parametrize("make", [
    lambda: np.array(3.5),                                       # 0-d
    lambda: np.zeros((0, 5), np.float32),                        # empty
    lambda: np.asfortranarray(np.arange(BIG, dtype=np.int32).reshape(256, -1)),
    lambda: np.arange(BIG, dtype=np.int64).reshape(64, -1)[:, ::3],  # strided
    lambda: np.arange(BIG, dtype=np.uint8)[::-1],                # negative stride
], ids=["0d", "empty", "fortran", "strided", "reversed"])
def test_shapes_and_layouts(echo2, make):
    array = make()
    out = echo2.generate(array)
    assert out.shape == array.shape and out.dtype == array.dtype
    np.testing.assert_array_equal(out, array)
    if array.flags.f_contiguous and not array.flags.c_contiguous:
        assert out.flags.f_contiguous


@pytest.mark.parametrize("size", [10, BIG])
def test_read_only_arrays_stay_read_only(echo2, size):
    array = np.arange(size, dtype=np.float64)
    array.flags.writeable = False
    out = echo2.generate(array)
    assert not out.flags.writeable
    np.testing.assert_array_equal(out, array)
    strided = np.arange(size * 2, dtype=np.float64)[::2]
    strided.flags.writeable = False
    assert not echo2.generate(strided).flags.writeable


def test_results_are_writable_views_of_shared_memory(echo2):
    out = echo2.generate(np.ones(BIG, np.uint8))
    assert out.flags.writeable
    assert (segment_of(out.ctypes.data) or "").startswith("/dev/shm/rdist.")
    out[:] = 3  # the caller owns it now


@dataclasses.dataclass
class Frames:
    video: np.ndarray
    audio: np.ndarray
    meta: dict


def test_nested_containers_and_dataclasses(echo2):
    value = {
        "clips": [Frames(np.full((4, 32, 32, 3), i, np.uint8), np.zeros(BIG, np.float32),
                         {"i": i}) for i in range(3)],
        "pair": (np.arange(BIG, dtype=np.int16), np.arange(5)),
        "nothing": None,
    }
    out = echo2.generate(value)
    assert type(out["clips"][1]) is Frames and out["clips"][2].meta == {"i": 2}
    for got, want in zip(out["clips"], value["clips"], strict=False):
        np.testing.assert_array_equal(got.video, want.video)
        np.testing.assert_array_equal(got.audio, want.audio)
    np.testing.assert_array_equal(out["pair"][0], value["pair"][0])
    assert out["nothing"] is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64,
                                   torch.bool, torch.uint8, torch.complex64], ids=str)
def test_cpu_tensors_round_trip_out_of_band(echo2, dtype):
    tensor = (torch.arange(BIG // 4) % 7).to(dtype).reshape(-1, 4)
    out = echo2.generate({"t": tensor, "scalar": torch.tensor(2.5), "empty": torch.empty(0, 3)})
    assert type(out["t"]) is torch.Tensor and out["t"].dtype == dtype
    assert out["t"].shape == tensor.shape and torch.equal(out["t"], tensor)
    assert out["scalar"].shape == () and float(out["scalar"]) == 2.5
    assert out["empty"].shape == (0, 3)
    transposed = tensor.t()  # non-contiguous
    assert torch.equal(echo2.generate(transposed), transposed)


def test_tensor_requires_grad_survives(echo2):
    tensor = torch.ones(BIG // 4, requires_grad=True)
    assert echo2.generate(tensor).requires_grad


def test_a_cpu_tensor_crosses_unchanged_and_out_of_band():
    tensor = torch.arange(BIG // 4, dtype=torch.float32)
    assert on_cpu(tensor) is tensor  # no copy decided for a CPU tensor
    stream, buffers = dumps({"t": tensor})
    assert [b.raw().tobytes() for b in buffers] == [tensor.numpy().tobytes()]
    out = pickle.loads(stream, buffers=buffers)["t"]
    assert out.device.type == "cpu" and torch.equal(out, tensor)


META_MESSAGE = (r"a torch \w+ on device 'meta' cannot be sent: tensors cross "
                r"the runner through the CPU, and copying it there failed \(NotImplementedError: "
                r"Cannot copy out of meta tensor.*it arrives on the CPU \(move it with "
                r"\.to\(device\)\)")


class Tagged(torch.Tensor):
    """A tensor subclass: torch pickles it through its storage."""


@pytest.mark.parametrize("make", [
    lambda: torch.empty(3, device="meta"),
    lambda: torch.empty(3, device="meta").untyped_storage(),
    lambda: torch.nn.Parameter(torch.empty(3, device="meta")),
    lambda: torch.empty(3, device="meta").as_subclass(Tagged),
], ids=["tensor", "storage", "parameter", "subclass"])
def test_no_tensor_off_the_cpu_is_pickled_by_torch_itself(make):
    """Every device but the CPU goes through on_cpu(): meta, which has no data to copy,
    is a TypeError saying so (torch's own pickling would have sent it)."""
    with pytest.raises(TypeError, match=META_MESSAGE):
        dumps([make()])


def test_a_meta_tensor_input_or_result_is_a_clear_type_error(echo2):
    with pytest.raises(TypeError, match="the input of generate\\(\\) cannot be pickled .*"
                                        + META_MESSAGE):
        echo2.generate({"t": torch.empty(3, device="meta")})
    with pytest.raises(TypeError, match=META_MESSAGE):
        echo2.generate(MetaTensor())
    assert echo2.healthy and echo2.generate(3) == 3


def test_large_payloads_never_travel_in_band():
    from reactor_dist.shm.ledger import Ledger
    from reactor_dist.wire import transfer
    from reactor_dist.wire.protocol import Place

    ledger = Ledger(segments.DEFAULT_DIR, segments.new_runner_prefix(), "t")
    try:
        value = {"a": np.ones((100, 1000)), "t": torch.ones(50_000),
                 "s": np.ones((1000, 1000))[:, ::2]}
        descriptors, frames, used = transfer.encode(value, ledger, "test", holders=["me"])
        assert len(frames[0]) < 1024  # the pickle stream holds descriptors only
        assert [d.place for d in descriptors] == [Place.SEGMENT] * 3
        assert len(used) == 1  # one copy segment for all of them
    finally:
        ledger.close()


def test_each_rank_may_write_its_input_unseen_by_the_others(echo2):
    original = np.arange(BIG, dtype=np.int32)
    for _ in range(3):  # the segment is reused: a written view must not leak into the next
        seen = echo2.generate(WriteInput(original))
        np.testing.assert_array_equal(seen, original)   # rank 0 did not see rank 1's writes
        np.testing.assert_array_equal(original, np.arange(BIG, dtype=np.int32))  # nor did we
    assert echo2.generate(original).sum() == original.sum()


def test_results_held_across_later_calls_stay_intact(echo2):
    held = [echo2.generate(FullArray((BIG,), fill=i)) for i in range(5)]
    for i in range(10):
        echo2.generate(FullArray((BIG,), fill=200 + i))
    for i, array in enumerate(held):
        assert (array == i).all()
    shared = [echo2.generate(SharedArray((BIG,), fill=50 + i)) for i in range(3)]
    for _ in range(10):
        echo2.generate(SharedArray((BIG,), fill=99))
    for i, array in enumerate(shared):
        assert (array == 50 + i).all()


def entries_and_bytes() -> tuple[int, int]:
    names = our_shm_entries()
    total = 0
    for n in names:
        try:
            total += os.stat(os.path.join(segments.DEFAULT_DIR, n)).st_blocks * 512
        except FileNotFoundError:
            pass
    return len(names), total


def test_memory_is_returned_when_results_are_dropped(echo2):
    size = 8 << 20
    echo2.generate(FullArray((size,)))
    baseline = entries_and_bytes()
    held = [echo2.generate(FullArray((size,), fill=i)) for i in range(8)]
    grown = entries_and_bytes()
    assert grown[0] >= baseline[0] + 6 and grown[1] >= baseline[1] + 6 * size
    del held
    echo2.generate(None)  # releases ride on the next command
    echo2.generate(None)
    after = entries_and_bytes()
    assert after[0] <= baseline[0] + 2 and after[1] <= baseline[1] + 2 * (size + (1 << 20))


def test_shared_empty_result_costs_no_copy(echo2):
    out = echo2.generate(SharedArray((3, BIG), fill=1.5, dtype="float32"))
    assert out.shape == (3, BIG) and out.dtype == np.float32 and (out == 1.5).all()
    name = segment_of(out.ctypes.data)
    assert name is not None and ".r0-" in name  # rank 0's pool: the very memory it filled


def test_input_too_big_for_shm_is_refused_before_sending(tmp_path, monkeypatch, log_dir):
    small = tmp_path / "shm"
    small.mkdir()
    monkeypatch.setenv(segments.LIMIT_ENV, str(64 << 20))
    with DistributedRunner(Echo, world_size=2, init_process_group=False, device="cpu",
                           shm_dir=str(small), load_kwargs={"log_dir": log_dir}) as runner:
        with pytest.raises(SharedMemoryExhausted) as info:
            runner.generate(np.zeros(97 << 20, np.uint8))
        message = str(info.value)
        assert "97.0 MiB" in message and "64.0 MiB in total" in message
        assert "--shm-size" in message and "free" in message
        assert runner.healthy
        np.testing.assert_array_equal(runner.generate(np.ones(BIG, np.uint8)), 1)
    with open(os.path.join(log_dir, "rank1.log")) as f:
        assert f.read().count("echo") == 1  # the refused call never reached a rank


def test_result_too_big_for_shm_is_rank0s_error_without_desync(tmp_path, monkeypatch):
    small = tmp_path / "shm"
    small.mkdir()
    monkeypatch.setenv(segments.LIMIT_ENV, str(64 << 20))
    with DistributedRunner(Echo, world_size=2, init_process_group=False, device="cpu",
                           shm_dir=str(small)) as runner:
        for step in (FullArray, SharedArray):
            with pytest.raises(SharedMemoryExhausted, match="97.0 MiB.*--shm-size"):
                runner.generate(step((97 << 20,)))
            assert runner.healthy
        assert runner.generate(FullArray((BIG,), fill=9)).sum() == 9 * BIG


def test_no_leak_after_sigkill_of_a_rank_mid_transfer():
    runner = DistributedRunner(Echo, world_size=2, init_process_group=False,
                               device="cpu")
    runner.start()
    big = np.ones(64 << 20, np.uint8)
    runner.generate(big)
    pid = Probe(runner).rank_pids[1]

    import threading

    killer = threading.Timer(0.01, os.kill, (pid, signal.SIGKILL))
    killer.start()
    try:
        with pytest.raises(WorkerCrashed):
            for _ in range(100):
                runner.generate(big)
    finally:
        killer.join()
        runner.shutdown()
    prefix = Probe(runner).shm_prefix + "."
    assert [n for n in os.listdir(segments.DEFAULT_DIR) if n.startswith(prefix)] == []


REAL_TMPFS_SCRIPT = textwrap.dedent("""
    import numpy as np
    from reactor_dist import DistributedRunner, SharedMemoryExhausted
    from sample_workers import Echo
    with DistributedRunner(Echo, world_size=2, init_process_group=False,
                           device="cpu") as runner:
        try:
            runner.generate(np.zeros(97 << 20, np.uint8))
        except SharedMemoryExhausted as exc:
            print("REFUSED", exc)
        print("HEALTHY", runner.healthy, int(runner.generate(np.ones(1 << 20, np.uint8)).sum()))
""")


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare")
def test_a_real_64mb_dev_shm_like_dockers_default(tmp_path):
    """Docker's default /dev/shm, for real: a 64 MB tmpfs in a private mount namespace."""
    probe = subprocess.run(["unshare", "-Urm", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("user namespaces are not available here (the injected-limit tests cover it)")
    (tmp_path / "app.py").write_text(REAL_TMPFS_SCRIPT)
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    repo = os.path.dirname(tests_dir)
    cmd = (f"mount -t tmpfs -o size=64m tmpfs /dev/shm && cd {tmp_path} && "
           f"PYTHONPATH={repo}:{tests_dir} {sys.executable} app.py")
    out = subprocess.run(["unshare", "-Urm", "sh", "-c", cmd], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "REFUSED cannot allocate 97.0 MiB" in out.stdout and "64.0 MiB in total" in out.stdout
    assert "HEALTHY True 1048576" in out.stdout


def test_module_runner_leaves_nothing(echo2):
    """Last test of the module: after shutdown, nothing of the shared runner is left."""
    pids = Probe(echo2).rank_pids
    echo2.shutdown()
    time.sleep(0.05)
    from conftest import wait_gone

    assert wait_gone(pids) == []
    assert our_shm_entries() == set()
