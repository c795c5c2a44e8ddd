"""`make gpu-check` (benchmarks/gpu_check.py) on a machine whose torch sees no CUDA: quiet
without an NVIDIA driver, an error saying how to install a CUDA build with one. The driver
probe is pointed at a file of the test's (REACTOR_DIST_NVIDIA_PROBE, a test hook)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

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
