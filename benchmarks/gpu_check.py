"""`make gpu-check`: the first contact with this machine's GPUs, in under 8 minutes.

On a machine with N GPUs (at most 8 are used) it runs, each step in a process of its own
with a timeout (all of them within ``BUDGET_S``):

1. the GPU-marked tests (tests/test_gpu.py) at world_size N with the group: NCCL bound
   and formed in ``start()``, an ``all_gather`` on CUDA and on CPU tensors,
   ``shared_empty`` filled from the device (and page-locked), CUDA tensors of every kind
   returned and streamed by rank 0, the input path (``to_device``), timings with a
   deliberately slow rank, ``reactor-dist doctor --device cuda``, and the third-party
   parallel models (transformers' tensor-parallel Llama, diffusers' context-parallel
   Wan) on NCCL against the CPU (world_size 2, or 1 on one GPU);
2. the Quickstart (docs/index.md, the README's too) as printed (world_size 2: skipped on one GPU);
3. the demo with ``--device cuda``;
4. the frame timings (``--frames``): every row of issue 43 with its floor, measured in
   the same run (benchmarks/gpu_frames.py: ``ROWS``); a row above its goal fails;
5. with two GPUs or more, a shape mismatch in an NCCL all_reduce (``--mismatch``): the
   report's first line (issue 45) must say the shapes differ.

Then it prints one table and exits non-zero if a step or a row failed.  Without CUDA in
torch: an NVIDIA driver on the machine (``/proc/driver/nvidia/version`` or
``nvidia-smi`` on PATH) is an error saying how to install a CUDA build; without a driver
either, it prints "no GPU: nothing to check" and exits 0.

``--current-env`` (``make gpu-check-here``): in the interpreter it runs in, installing
nothing (GPU machines are often offline containers with torch, transformers and
diffusers already there); it first names each package of :data:`PACKAGES` that is
missing and what its absence skips.  Test hook: ``REACTOR_DIST_NVIDIA_PROBE`` names the
file whose existence means "a driver is here", instead of both probes.
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

PROBE_ENV = "REACTOR_DIST_NVIDIA_PROBE"
DRIVER_FILE = "/proc/driver/nvidia/version"
WORLD_SIZE_ENV = "REACTOR_DIST_GPU_WORLD_SIZE"  # read by tests/test_gpu.py
MOST_GPUS = 8
BUDGET_S = 450  # every step together: under 8 minutes with the start-up around them
TRIALS = 20  # timed calls per frame row, after WARM untimed ones
WARM = 3
INSTALL = ('make clean && make gpu-check TORCH_SPEC="torch==2.13.0 --index-url '
           'https://download.pytorch.org/whl/cu128" (a CUDA build matching your driver; '
           "plain torch==2.13.0 from PyPI is the CUDA build on Linux x86-64)")


# What the check imports, by distribution name: (its import name, what lacking it skips).
# reactor_dist's own dependencies and torch it cannot do without.
PACKAGES: dict[str, tuple[str, str]] = {
    "pyzmq": ("zmq", "everything (reactor_dist needs it)"),
    "msgpack": ("msgpack", "everything (reactor_dist needs it)"),
    "numpy": ("numpy", "everything (reactor_dist needs it)"),
    "psutil": ("psutil", "everything (reactor_dist needs it)"),
    "torch": ("torch", "everything (there is no GPU to check without it)"),
    "pytest": ("pytest", "the GPU-marked tests and the Quickstart step"),
    "pillow": ("PIL", "the demo step"),
    "transformers": ("transformers", "the tensor-parallel Llama test and the "
                     "context-parallel Wan test (diffusers' Wan imports transformers)"),
    "diffusers": ("diffusers", "the context-parallel Wan test"),
}
NEEDED = ("pyzmq", "msgpack", "numpy", "psutil", "torch")


def importable(module: str) -> bool:
    """Whether ``module`` can be imported here, without importing it (a module set to
    None in sys.modules, as a test hides one, is not)."""
    import importlib.util

    if module in sys.modules:
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def missing_packages(packages: dict[str, tuple[str, str]] = PACKAGES) -> list[str]:
    """The distributions of ``packages`` that this interpreter cannot import, in order."""
    return [name for name, (module, _) in packages.items() if not importable(module)]


def environment_report(missing: list[str],
                       packages: dict[str, tuple[str, str]] = PACKAGES) -> str:
    """What ``--current-env`` prints before it runs: the interpreter, and each missing
    package with what its absence skips."""
    version = ".".join(str(v) for v in sys.version_info[:3])
    lines = [f"gpu-check in the current environment: {sys.executable} (Python {version}), "
             "installing nothing"]
    if not missing:
        lines.append("every package it uses is here: " + ", ".join(packages))
    for name in missing:
        lines.append(f"missing: {name} (skips {packages[name][1]})")
    return "\n".join(lines)


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


def check(n: int, missing: list[str] = ()) -> int:
    """Every step at world_size ``n``; a step that needs a package of ``missing`` is
    skipped and says so."""
    py, deadline = sys.executable, time.perf_counter() + BUDGET_S
    env = {**os.environ, WORLD_SIZE_ENV: str(n)}
    demo_ranks = max(d for d in (1, 2, 4, 8) if d <= n)  # a divisor of its 16 frames
    work = tempfile.mkdtemp(prefix="gpu-check-")
    frames = os.path.join(work, "frames.json")
    mismatch = os.path.join(work, "mismatch.txt")
    no_pytest = "skipped (pytest is missing)" if "pytest" in missing else ""
    steps = [
        (f"GPU-marked tests, world_size {n}", no_pytest,
         [py, "-m", "pytest", "-q", "-m", "gpu", "tests/test_gpu.py"], 270),
        ("Quickstart as printed",
         no_pytest or ("" if n >= 2 else "skipped (needs 2 GPUs: world_size=2 as printed)"),
         [py, "-m", "pytest", "-q",
          "tests/test_docs_examples.py::test_quickstart_runs_as_printed"], 60),
        (f"demo --device cuda, world_size {demo_ranks}",
         "skipped (pillow is missing)" if "pillow" in missing else "",
         [py, "examples/demo.py", "--device", "cuda", "--world-size", str(demo_ranks),
          "--out", os.path.join(work, "demo")], 60),
        ("frame timings", "", [py, "-m", "benchmarks.gpu_check", "--frames", frames], 150),
        ("a collective's shape mismatch, world_size 2",
         "" if n >= 2 else "skipped (needs 2 GPUs: a collective between two ranks)",
         [py, "-m", "benchmarks.gpu_check", "--mismatch", mismatch], 60),
    ]
    rows, failed = [], []
    for name, skipped, cmd, limit in steps:
        if skipped:
            rows.append((name, skipped, ""))
            continue
        log = os.path.join(work, f"step{len(rows)}.log")
        outcome, took = run_step(cmd, min(limit, deadline - time.perf_counter()), env, log)
        rows.append((name, outcome, f"{took:.1f} s"))
        if outcome != "ok":
            failed.append((name, log))
    if os.path.exists(frames):
        from benchmarks.gpu_frames import frame_rows

        with open(frames) as f:
            for label, text, over in frame_rows(json.load(f)):
                rows.append((f"  {label}", text, ""))
                if over:
                    failed.append((label, None))
    if os.path.exists(mismatch):
        with open(mismatch) as f:
            rows.append(("  the report's first line", f.readline().strip(), ""))
    for name, log in failed:
        if log is not None:
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
def timed(fn, trials: int = TRIALS) -> dict[str, float]:
    """The median and p90 seconds of ``trials`` calls of ``fn`` (each result dropped
    before the next call: pools reuse what the caller let go)."""
    times = []
    for _ in range(trials):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
        del result
    return summary(times)


def summary(times: list[float]) -> dict[str, float]:
    times = sorted(times)
    return {"median": statistics.median(times), "p90": times[int(len(times) * 0.9)]}


def attempt(timings: dict[str, dict], keys: tuple[str, ...], measure) -> None:
    """``timings.update(measure())``; an error becomes each of ``keys``' row, so that the
    other rows are still measured."""
    try:
        timings.update(measure())
    except Exception as e:  # reported in the table: the row with a goal then fails
        for key in keys:
            timings[key] = {"error": f"{type(e).__name__}: {e}"[:160]}


def returned(runner, trials: int = TRIALS) -> dict[str, dict]:
    """Rank 0's results of every kind (benchmarks/gpu_frames.py), the first call of the
    bare tensor on its own (what registering its segment costs), then the steady state
    (``trials`` calls each)."""
    import numpy as np

    from benchmarks.gpu_frames import SHAPE

    out: dict[str, dict] = {}
    start = time.perf_counter()
    first = runner.generate("tensor")
    out["tensor_first"] = {"median": time.perf_counter() - start}
    del first
    for _ in range(WARM):
        runner.generate(None)
    out["empty"] = timed(lambda: runner.generate(None), 15 * trials)
    for kind in ("tensor", "dataclass", "bf16", "numpy", "shared"):
        attempt(out, (kind,), lambda kind=kind: {
            kind: warm_and_timed(lambda: runner.generate(kind), trials)})
    x = np.random.default_rng(0).integers(0, 255, SHAPE, np.uint8)
    attempt(out, ("to_device",), lambda: {"to_device": summary(
        [runner.generate(x) for _ in range(WARM + trials)][WARM:])})
    return out


def warm_and_timed(fn, trials: int = TRIALS) -> dict:
    for _ in range(WARM):
        fn()
    return timed(fn, trials)


def streamed(runner, trials: int = TRIALS) -> dict[str, dict]:
    """The same results yielded, one item per step."""
    out: dict[str, dict] = {}
    for kind in ("tensor", "dataclass", "bf16"):
        attempt(out, (f"stream_{kind}",), lambda kind=kind: {
            f"stream_{kind}": warm_and_timed(lambda: list(runner.stream(kind)), trials)})
    return out


def frame_timings(path: str) -> int:
    """Measure every row of benchmarks/gpu_frames.ROWS into ``path`` (JSON): the floors
    before and after the runners (the faster of the two counts), the runners between."""
    from benchmarks.gpu_frames import ROWS, GpuFrames, GpuFramesStream, floors
    from reactor_dist import DistributedRunner

    floor_keys = tuple(r.key for r in ROWS if r.key.startswith("floor") or "shm" in r.key)
    timings: dict[str, dict] = {}
    attempt(timings, floor_keys, lambda: floors(timed))
    rank_keys = tuple(r.key for r in ROWS if r.key not in floor_keys and
                      not r.key.startswith("stream"))
    runner = DistributedRunner(GpuFrames, world_size=1, device="cuda", call_timeout=120.0)
    start = time.perf_counter()
    try:
        runner.start()
        timings["start"] = {"median": time.perf_counter() - start}
        attempt(timings, rank_keys, lambda: returned(runner))
    except Exception as e:
        for key in rank_keys:
            timings.setdefault(key, {"error": f"{type(e).__name__}: {e}"[:160]})
    finally:
        runner.shutdown()
    stream_keys = tuple(r.key for r in ROWS if r.key.startswith("stream"))

    def streams() -> dict[str, dict]:
        with DistributedRunner(GpuFramesStream, world_size=1, device="cuda",
                               call_timeout=120.0) as runner:
            return streamed(runner)

    attempt(timings, stream_keys, streams)
    again: dict[str, dict] = {}
    attempt(again, floor_keys, lambda: floors(timed))
    for key in floor_keys:
        if "median" in again.get(key, {}) and \
                again[key]["median"] < timings.get(key, {}).get("median", float("inf")):
            timings[key] = again[key]
    with open(path, "w") as f:
        json.dump(timings, f)
    return 0


def shape_mismatch(path: str, device: str = "cuda") -> int:
    """Rank 1 passes an all_reduce 8 elements where rank 0 passes 4, over NCCL (issue 45;
    ``device="cpu"``: gloo, which aborts a rank instead of hanging): the error's first
    line, written to ``path``, must name the shapes."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), "tests"))
    from collective_workers import Collectives

    from reactor_dist import DistributedRunner, WorkerCrashed, WorkerTimeout

    with DistributedRunner(Collectives, world_size=2, device=device, call_timeout=10.0,
                           shutdown_grace=1.0) as runner:
        runner.generate("ok")
        try:
            runner.generate("shape")
            first = "no error: the mismatch was not reported"
        except (WorkerTimeout, WorkerCrashed) as e:
            first = str(e).split("\n")[0]
    with open(path, "w") as f:
        f.write(first + "\n")
    print(first)
    return 0 if first.endswith("the shapes differ") else 1


def main(argv: list[str]) -> int:
    if argv[:1] == ["--frames"]:
        return frame_timings(argv[1])
    if argv[:1] == ["--mismatch"]:
        return shape_mismatch(*argv[1:3])
    missing: list[str] = []
    if argv[:1] == ["--current-env"]:
        missing = missing_packages()
        print(environment_report(missing), flush=True)
        needed = [name for name in missing if name in NEEDED]
        if needed:
            print(f"gpu-check: cannot run without {', '.join(needed)}", file=sys.stderr)
            return 1
        from reactor_dist.wire import framing

        print("framing's compiled half: " + ("in use" if framing.COMPILED is not None else
              "not built here (make compiled-here), the pure-Python path runs"), flush=True)
    elif argv:
        print(f"usage: python -m benchmarks.gpu_check [--current-env] (got {argv})",
              file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        code, message = no_cuda_verdict(torch)
        print(message, file=sys.stderr if code else sys.stdout)
        return code
    return check(min(torch.cuda.device_count(), MOST_GPUS), missing)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
