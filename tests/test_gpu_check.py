"""`make gpu-check` (benchmarks/gpu_check.py) on a machine whose torch sees no CUDA: quiet
without an NVIDIA driver, an error saying how to install a CUDA build with one. The driver
probe is pointed at a file of the test's (REACTOR_DIST_NVIDIA_PROBE, a test hook)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from reactor_dist.wire import framing

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only branch")


def gpu_check(probe: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.gpu_check"], cwd=REPO,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "REACTOR_DIST_NVIDIA_PROBE": probe})


def test_no_driver_and_no_cuda_is_nothing_to_check(tmp_path):
    out = gpu_check(str(tmp_path / "absent"))
    assert (out.returncode, out.stdout, out.stderr) == (0, "no GPU: nothing to check\n", "")


def test_a_driver_with_a_cpu_build_of_torch_fails_and_says_how_to_install_cuda(tmp_path):
    probe = tmp_path / "version"
    probe.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.00\n")
    out = gpu_check(str(probe))
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr == (
        f"gpu-check: an NVIDIA driver is present ({probe}), but torch {torch.__version__} "
        f"in {sys.prefix} is a CPU build. Install a CUDA build: make clean && make gpu-check "
        'TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128" '
        "(a CUDA build matching your driver; plain torch==2.13.0 from PyPI is the CUDA "
        "build on Linux x86-64)\n")


# -- make gpu-check-here: the current environment, installing nothing -------------------------
# Run as `python -m benchmarks.gpu_check --current-env`, with the named modules hidden
# (None in sys.modules: their import fails, as where they are not installed).
HIDDEN_RUN = ("import sys, runpy; sys.modules.update(dict.fromkeys(sys.argv[1].split(','))); "
              "sys.argv[1:] = ['--current-env']; "
              "runpy.run_module('benchmarks.gpu_check', run_name='__main__')")


COMPILED_HALF = "in use" if framing.COMPILED is not None else \
    "not built here (make compiled-here), the pure-Python path runs"


def here(tmp_path, hidden: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", HIDDEN_RUN, hidden], cwd=REPO,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "REACTOR_DIST_NVIDIA_PROBE": str(tmp_path / "no")})


def test_the_current_environment_names_each_missing_package_and_what_it_skips(tmp_path):
    out = here(tmp_path, "PIL,transformers,diffusers")
    version = ".".join(str(v) for v in sys.version_info[:3])
    assert (out.returncode, out.stderr) == (0, "")
    assert out.stdout == (
        f"gpu-check in the current environment: {sys.executable} (Python {version}), "
        "installing nothing\n"
        "missing: pillow (skips the demo step)\n"
        "missing: transformers (skips the tensor-parallel Llama test and the "
        "context-parallel Wan test (diffusers' Wan imports transformers))\n"
        "missing: diffusers (skips the context-parallel Wan test)\n"
        f"framing's compiled half: {COMPILED_HALF}\n"
        "no GPU: nothing to check\n")


def test_the_current_environment_without_a_package_reactor_dist_needs_fails(tmp_path):
    out = here(tmp_path, "psutil,transformers,diffusers")
    assert out.returncode == 1
    assert out.stdout.splitlines()[1:] == [
        "missing: psutil (skips everything (reactor_dist needs it))",
        "missing: transformers (skips the tensor-parallel Llama test and the "
        "context-parallel Wan test (diffusers' Wan imports transformers))",
        "missing: diffusers (skips the context-parallel Wan test)"]
    assert out.stderr == "gpu-check: cannot run without psutil\n"


def test_a_package_that_is_not_installed_is_missing_and_one_that_is_is_not():
    from benchmarks.gpu_check import missing_packages

    packages = {"numpy": ("numpy", "x"), "absent": ("reactor_dist_no_such_module", "y"),
                "a submodule": ("reactor_dist_no_such_module.sub", "z")}
    assert missing_packages(packages) == ["absent", "a submodule"]


# -- the frame timings' table (benchmarks/gpu_frames.py), from given numbers ---------------------
def timings(**medians_ms) -> dict:
    from benchmarks.gpu_frames import ROWS

    out = {row.key: {"median": 2e-3, "p90": 3e-3} for row in ROWS}
    out["start"] = {"median": 4.0}
    out["tensor_first"] = {"median": 0.012}
    out.update({k: {"median": v / 1e3, "p90": v / 1e3} for k, v in medians_ms.items()})
    return out


def test_every_row_of_issue_43_is_judged_against_its_floor():
    from benchmarks.gpu_frames import frame_rows

    rows = frame_rows(timings(floor_d2h=2.0, tensor=2.4, floor_d2h_bf16=1.0, bf16=1.2,
                              stream_bf16=1.1,
                              numpy=90.0, floor_h2d=2.0, to_device=2.2))
    assert [label for label, _, _ in rows] == [
        "start() to ready, 1 rank", "empty call",
        "floor: D2H of the 97 MB uint8 into pinned memory",
        "floor: D2H of the 50 MB bf16 into pinned memory",
        "floor: H2D of 97 MB from pinned memory",
        "97 MB uint8 CUDA tensor, first call (registration)",
        "97 MB uint8 CUDA tensor, steady state", "a dataclass holding it",
        "50 MB bf16 CUDA tensor", "stream: the 97 MB uint8 tensor, one item",
        "stream: the dataclass, one item", "stream: the 50 MB bf16 tensor, one item",
        "97 MB returned as .cpu().numpy()", "97 MB through shared_empty, filled from the GPU",
        "97 MB input, self.to_device(x) in the worker", "D2H into plain shared memory",
        "D2H into registered shared memory"]
    table = {label: (text, failed) for label, text, failed in rows}
    assert table["start() to ready, 1 rank"] == ("4.00 s", False)
    assert table["97 MB uint8 CUDA tensor, steady state"] == (
        "median 2.40 ms, p90 2.40 ms, 40.4 GB/s; 1.20× floor (goal ≤ 1.2×): ok", False)
    assert table["50 MB bf16 CUDA tensor"] == (
        "median 1.20 ms, p90 1.20 ms, 41.7 GB/s; 1.20× floor (goal ≤ 1.2×): ok", False)
    assert table["97 MB uint8 CUDA tensor, first call (registration)"] == (
        "median 12.00 ms, 8.1 GB/s; 6.00× floor", False)
    assert table["97 MB returned as .cpu().numpy()"] == (
        "median 90.00 ms, p90 90.00 ms, 1.1 GB/s; 45.00× floor", False)  # no goal: reported
    assert table["97 MB input, self.to_device(x) in the worker"] == (
        "median 2.20 ms, p90 2.20 ms, 44.1 GB/s; 1.10× floor (goal ≤ 1.2×): ok", False)
    assert not any(failed for _, _, failed in rows)


def test_a_row_above_its_goal_fails_and_so_does_one_not_measured():
    from benchmarks.gpu_frames import frame_rows

    given = timings(floor_d2h=2.0, dataclass=2.5, floor_h2d=2.0)
    given["to_device"] = {"error": "AttributeError: no to_device"}
    del given["stream_bf16"]
    failed = {label: text for label, text, over in frame_rows(given) if over}
    assert failed == {
        "a dataclass holding it":
            "median 2.50 ms, p90 2.50 ms, 38.8 GB/s; 1.25× floor (goal ≤ 1.2×): FAILED",
        "97 MB input, self.to_device(x) in the worker": "error: AttributeError: no to_device",
        "stream: the 50 MB bf16 tensor, one item": "not measured"}
    given = timings()
    given["floor_d2h_bf16"] = {"error": "RuntimeError: out of memory"}
    assert [(label, text) for label, text, over in frame_rows(given) if over] == [
        ("50 MB bf16 CUDA tensor",
         "median 2.00 ms, p90 3.00 ms, 25.0 GB/s; its floor was not measured: FAILED"),
        ("stream: the 50 MB bf16 tensor, one item",
         "median 2.00 ms, p90 3.00 ms, 25.0 GB/s; its floor was not measured: FAILED")]


def test_make_bench_has_the_same_rows_judged_the_same_way():
    from benchmarks.config import Settings
    from benchmarks.families import frames_gpu
    from benchmarks.report.results import Results
    from benchmarks.report.stats import summarize

    results = Results()
    given = {"floor_d2h": 2.0e-3, "tensor": 2.3e-3, "dataclass": 2.5e-3, "numpy": 90e-3,
             "floor_h2d": 2.0e-3, "to_device": 2.2e-3, "start": 4.0}
    for key, seconds in given.items():
        results.put(frames_gpu.METRIC, key, "seconds", summarize([seconds]))
    rows = frames_gpu.rows(results, Settings(quick=True))
    assert [(r.case, r.unit, r.target, r.met) for r in rows] == [
        ("start() to ready, 1 rank", "s", "", None),
        ("floor: D2H of the 97 MB uint8 into pinned memory", "ms", "", None),
        ("floor: H2D of 97 MB from pinned memory", "ms", "", None),
        ("97 MB uint8 CUDA tensor, steady state", "ms", "≤ 1.2× floor", True),
        ("a dataclass holding it", "ms", "≤ 1.2× floor", False),
        ("97 MB returned as .cpu().numpy()", "ms", "", None),
        ("97 MB input, self.to_device(x) in the worker", "ms", "≤ 1.2× floor", True)]
    assert [round(r.over_floor, 2) for r in rows if r.floor is not None] == [
        1.15, 1.25, 45.0, 1.1]


def test_make_bench_without_a_gpu_says_so(capsys):
    from benchmarks.config import Settings
    from benchmarks.families import frames_gpu
    from benchmarks.report.results import Results

    results = Results()
    frames_gpu.measure(Settings(quick=True), results)  # this machine: torch sees no GPU
    assert results.stats == {} and results.notes == []  # no rows, and no problem
    assert frames_gpu.rows(results, Settings(quick=True)) == []
    assert capsys.readouterr().out == (
        "gpu frames: no CUDA GPU here; the rows of frames between a GPU and the application "
        "run where one is (make bench, make gpu-check)\n")


def test_the_mismatch_step_writes_the_reports_first_line(tmp_path):
    """The step gpu-check runs over NCCL with two GPUs, here over gloo (which aborts the
    rank instead of hanging): the same first line."""
    path = tmp_path / "mismatch.txt"
    out = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--mismatch",
                          str(path), "cpu"], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert path.read_text() == (
        "all_reduce #1 of call 2: rank 0 has [4] float32, rank 1 has [8] float32 — the "
        "shapes differ\n")
