"""/dev/shm under pressure, on a real 64 MiB tmpfs (Docker's default size): memory goes
back to whoever needs it without waiting for the next call; warm pools are a cache,
never a hoard; the error when memory is truly short stays clear.

Each test runs tests/shm_pressure_app.py in a private mount namespace (``unshare``)
whose tmpfs, mounted with size=64m, is the runner's shm_dir: the kernel's own limit,
unlinked-but-mapped pages included, not an injected one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from conftest import segment_of
from probe import Probe
from sample_workers import Echo, FullArray, SlowArray

from reactor_dist import DistributedRunner
from reactor_dist.shm.ledger import IDLE_RETURN

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)
needs_unshare = pytest.mark.skipif(shutil.which("unshare") is None,
                                   reason="needs util-linux unshare")


def run_on_64mib_tmpfs(scenario: str, tmp_path) -> list[str]:
    mount = tmp_path / "shm"
    mount.mkdir()
    if subprocess.run(["unshare", "-Urm", "true"], capture_output=True).returncode != 0:
        pytest.skip("user and mount namespaces are not available here")
    cmd = (f"mount -t tmpfs -o size=64m tmpfs {mount} && cd {tmp_path} && "
           f"PYTHONPATH={REPO}:{TESTS} {sys.executable} {TESTS}/shm_pressure_app.py "
           f"{scenario} {mount}")
    out = subprocess.run(["unshare", "-Urm", "sh", "-c", cmd], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


@needs_unshare
def test_a_stream_of_16_items_of_16_mb_completes_on_64_mib(tmp_path):
    """The caller's releases reach rank 0 during the stream (4 items fit at once)."""
    assert run_on_64mib_tmpfs("stream", tmp_path) == [
        "stream 16 of 16", "astream 16 of 16", "stream 16 of 16", "left []"]


@needs_unshare
def test_after_a_stream_of_big_items_a_16_mb_input_still_fits(tmp_path):
    """Rank 0 keeps the stream's segments warm: the input's allocation gets them back."""
    assert run_on_64mib_tmpfs("input-after-stream", tmp_path) == [
        "held 4 of 4", "16 MB input [0, 0, 0, 0, 0, 0, 0, 0]", "left []"]


@needs_unshare
def test_idle_warm_segments_are_given_back_after_a_short_idle_time(tmp_path):
    assert run_on_64mib_tmpfs("idle", tmp_path) == [
        "held 4 of 4", "free after the stream 0", "free after idling 64", "left []"]


@needs_unshare
def test_memory_truly_short_is_the_same_clear_error_and_the_runner_goes_on(tmp_path):
    lines = run_on_64mib_tmpfs("truly-short", tmp_path)
    assert lines[0].startswith("refused cannot allocate 16.0 MiB of shared memory for item ")
    assert lines[0].endswith(" of generate() on rank 0 True")
    assert lines[1:] == ["healthy True", "stream 8 of 8", "left []"]


def test_a_call_longer_than_the_idle_time_gets_its_result_in_the_warm_segment():
    """The caller drops idle mappings while the call runs (nothing sent for IDLE_RETURN
    seconds); rank 0 reuses its warm segment, and the caller maps it anew."""
    with DistributedRunner(Echo, world_size=2, init_process_group=False,
                           device="cpu") as runner:
        first = runner.generate(FullArray((8 << 20,), fill=1))
        warm = segment_of(first.ctypes.data)
        del first
        second = runner.generate(SlowArray((8 << 20,), fill=2, seconds=IDLE_RETURN * 1.5))
        assert segment_of(second.ctypes.data) == warm and (second == 2).all()


def test_a_result_kept_past_shutdown_writes_to_no_descriptor_of_ours_when_dropped():
    """The releaser's wake pipe is closed at shutdown and its numbers go to the next
    files opened: a result dropped later must not write its wake-up byte into them."""
    with DistributedRunner(Echo, world_size=2, init_process_group=False,
                           device="cpu") as runner:
        kept = runner.generate(FullArray((1 << 20,), fill=3))
        number = Probe(runner).releaser_wake_fd
    read, write = os.pipe()
    os.dup2(write, number)  # a file of ours now has the releaser's old number
    try:
        os.set_blocking(read, False)
        del kept
        with pytest.raises(BlockingIOError):
            os.read(read, 16)
    finally:
        for fd in {read, write, number}:
            os.close(fd)
