"""`make gpu-check`: the first contact with this machine's GPUs, in under 8 minutes.

On a machine with N GPUs (at most 8 are used) it runs, each step in a process of its own
with a timeout (all of them within ``BUDGET_S``):

1. the GPU-marked tests (tests/test_gpu.py) at world_size N with the group: NCCL bound
   and formed in ``start()``, an ``all_gather`` on CUDA and on CPU tensors,
   ``shared_empty`` filled from the device (and page-locked), a CUDA tensor returned by
   rank 0, timings with a deliberately slow rank, ``reactor-dist doctor --device cuda``,
   and the third-party parallel models (transformers' tensor-parallel Llama, diffusers'
   context-parallel Wan) on NCCL against the CPU (world_size 2, or 1 on one GPU);
2. the Quickstart (docs/index.md, the README's too) as printed (world_size 2: skipped on one GPU);
3. the demo with ``--device cuda``;
4. the frame timings (``--frames``): 97 MB of frames on the GPU returned as
   ``.cpu().numpy()`` and through ``shared_empty``, and device-to-host copies into pinned
   memory (the floor), into plain and into registered shared memory.

Then it prints one table and exits non-zero if a step failed.  Without CUDA in torch: an
NVIDIA driver on the machine (``/proc/driver/nvidia/version`` or ``nvidia-smi`` on PATH)
is an error saying how to install a CUDA build; without a driver either, it prints
"no GPU: nothing to check" and exits 0.  Test hook: ``REACTOR_DIST_NVIDIA_PROBE`` names
the file whose existence means "a driver is here", instead of both probes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

PROBE_ENV = "REACTOR_DIST_NVIDIA_PROBE"
DRIVER_FILE = "/proc/driver/nvidia/version"
WORLD_SIZE_ENV = "REACTOR_DIST_GPU_WORLD_SIZE"  # read by tests/test_gpu.py
MOST_GPUS = 8
BUDGET_S = 450  # every step together: under 8 minutes with the start-up around them
SHAPE = (81, 480, 832, 3)  # 97 MB of uint8 RGB frames
NBYTES = int(np.prod(SHAPE))
INSTALL = ('make clean && make gpu-check TORCH_SPEC="torch==2.13.0 --index-url '
           'https://download.pytorch.org/whl/cu128" (a CUDA build matching your driver; '
           "plain torch==2.13.0 from PyPI is the CUDA build on Linux x86-64)")


def nvidia_driver() -> str | None:
    """Where an NVIDIA driver shows itself on this machine, or None."""
    probe = os.environ.get(PROBE_ENV)
    if probe is not None:
        return probe if os.path.exists(probe) else None
    if os.path.exists(DRIVER_FILE):
        return DRIVER_FILE
    return shutil.which("nvidia-smi")


def no_cuda_verdict(torch) -> tuple[int, str]:
    """The exit status and message when torch sees no CUDA device."""
    driver = nvidia_driver()
    if driver is None:
        return 0, "no GPU: nothing to check"
    if torch.version.cuda is None:
        why = f"torch {torch.__version__} in {sys.prefix} is a CPU build"
        fix = f"Install a CUDA build: {INSTALL}"
    else:
        why = f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU"
        fix = ("Check CUDA_VISIBLE_DEVICES and that the driver supports that CUDA version "
               f"(nvidia-smi), or install a build for your driver: {INSTALL}")
    return 1, f"gpu-check: an NVIDIA driver is present ({driver}), but {why}. {fix}"


# -- the steps --------------------------------------------------------------------------
def run_step(cmd: list[str], timeout: float, env: dict[str, str], log: str) -> tuple[str, float]:
    """Run ``cmd`` in a session of its own (its ranks too) for at most ``timeout`` s."""
    began = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=max(timeout, 1))
            outcome = "ok" if code == 0 else f"FAILED (exit {code})"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            outcome = f"FAILED (timed out after {timeout:.0f} s)"
    return outcome, time.perf_counter() - began


def tail(path: str, lines: int = 25) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


def check(n: int) -> int:
    py, deadline = sys.executable, time.perf_counter() + BUDGET_S
    env = {**os.environ, WORLD_SIZE_ENV: str(n)}
    demo_ranks = max(d for d in (1, 2, 4, 8) if d <= n)  # a divisor of its 16 frames
    work = tempfile.mkdtemp(prefix="gpu-check-")
    steps = [
        (f"GPU-marked tests, world_size {n}", [py, "-m", "pytest", "-q", "-m", "gpu",
                                               "tests/test_gpu.py"], 270),
        ("Quickstart as printed", [py, "-m", "pytest", "-q",
                                   "tests/test_docs_examples.py::test_quickstart_runs_as_printed"]
         if n >= 2 else None, 60),
        (f"demo --device cuda, world_size {demo_ranks}",
         [py, "examples/demo.py", "--device", "cuda", "--world-size", str(demo_ranks),
          "--out", os.path.join(work, "demo")], 60),
        ("frame timings", [py, "-m", "benchmarks.gpu_check", "--frames",
                           os.path.join(work, "frames.json")], 60),
    ]
    rows, failed = [], []
    for name, cmd, limit in steps:
        if cmd is None:
            rows.append((name, "skipped (needs 2 GPUs: world_size=2 as printed)", ""))
            continue
        log = os.path.join(work, f"step{len(rows)}.log")
        outcome, took = run_step(cmd, min(limit, deadline - time.perf_counter()), env, log)
        rows.append((name, outcome, f"{took:.1f} s"))
        if outcome != "ok":
            failed.append((name, log))
    frames = os.path.join(work, "frames.json")
    if os.path.exists(frames):
        with open(frames) as f:
            rows += [(f"  {name}", text, "") for name, text in json.load(f)]
    for name, log in failed:
        print(f"\n--- {name}: last lines of {log}\n{tail(log)}")
    import torch

    print(f"\n{n} x {torch.cuda.get_device_name(0)}, torch {torch.__version__} "
          f"(CUDA {torch.version.cuda})")
    width = max(len(r[0]) for r in rows) + 2
    print(f"{'check':<{width}}{'result':<52}time")
    for name, outcome, took in rows:
        print(f"{name:<{width}}{outcome:<52}{took}")
    return 1 if failed else 0


# -- the frame timings (a step of its own) ------------------------------------------------
def timed(fn, trials: int) -> tuple[float, float]:
    times = []
    for _ in range(trials):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
        del result
    times.sort()
    return statistics.median(times), times[int(len(times) * 0.9)]


def described(times: tuple[float, float], nbytes: int = 0) -> str:
    median, p90 = times
    rate = f", {nbytes / median / 1e9:.1f} GB/s" if nbytes else ""
    return f"median {median * 1e3:.2f} ms, p90 {p90 * 1e3:.2f} ms{rate}"


def frame_timings(path: str) -> int:
    import torch

    from benchmarks.gpu_frames import GpuFrames, copies_into_shared_memory
    from reactor_dist import DistributedRunner

    rows = []
    start = time.perf_counter()
    with DistributedRunner(GpuFrames, world_size=1, device="cuda") as runner:
        rows.append(("start() to ready, 1 rank", f"{time.perf_counter() - start:.2f} s"))
        for _ in range(5):
            runner.generate("shared")
        rows.append(("empty call", described(timed(lambda: runner.generate(None), 300))))
        rows.append(("97 MB frames, .cpu().numpy()",
                     described(timed(lambda: runner.generate("plain"), 20), NBYTES)))
        rows.append(("97 MB frames, shared_empty",
                     described(timed(lambda: runner.generate("shared"), 20), NBYTES)))
    frames = torch.randint(0, 255, SHAPE, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(SHAPE, dtype=torch.uint8, pin_memory=True)
    rows.append(("floor: D2H into pinned memory",
                 described(timed(lambda: pinned.copy_(frames), 20), NBYTES)))
    for name, times in copies_into_shared_memory(frames, timed):
        rows.append((name, described(times, NBYTES)))
    with open(path, "w") as f:
        json.dump(rows, f)
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["--frames"]:
        return frame_timings(argv[1])
    import torch

    if not torch.cuda.is_available():
        code, message = no_cuda_verdict(torch)
        print(message, file=sys.stderr if code else sys.stdout)
        return code
    return check(min(torch.cuda.device_count(), MOST_GPUS))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
