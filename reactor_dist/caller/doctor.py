"""``reactor-dist doctor``: is this machine ready to run ``world_size`` ranks?

Each check is a :class:`Check`: a name, whether it passed (None: only information),
what was found and, when it failed, the fix.  The last check is a real smoke run:
``world_size`` ranks form the torch.distributed group, run one all_reduce, and rank 0
sends one 16 MiB frame back through shared memory (one rank forms no group: it skips the
all_reduce).  The command prints a table and
exits 1 when any check failed.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from dataclasses import dataclass

import numpy as np

from ..device import device_kind, usable_cores
from ..shm import segments
from ..worker import DistributedWorker
from . import open_files

MiB = 1 << 20
FRAME_BYTES = 16 * MiB     # the smoke run's frame, and the default --frame-mb
FRAMES_HELD = 8            # /dev/shm must hold this many frames: see check_shm
MIN_OPEN_FILES = 1024
MIN_LOCKED_CUDA = 64 * MiB


@dataclass
class Check:
    name: str
    ok: bool | None  # None: information only
    found: str
    fix: str = ""


class SmokeWorker(DistributedWorker):
    """The smoke run's model: one all_reduce over every rank, then rank 0 fills a frame.
    A single rank forms no group (server.py), so it has nothing to reduce."""

    def generate(self, nbytes: int, /):
        import torch

        total = torch.ones(1, device=self.device) * (self.rank + 1)
        if self.world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(total)
        frame = self.shared_empty(nbytes, np.uint8)
        frame[:] = self.world_size % 251
        return {"sum": float(total.item()), "frame": frame}


def check_shm(shm_dir: str, frame_bytes: int) -> Check:
    """Enough room for FRAMES_HELD frames: an input and a result segment in flight, the
    warm segments each pool keeps (keep_free_segments=2 on each side) and headroom."""
    try:
        total, free = segments.capacity(shm_dir)
    except OSError as exc:
        return Check("shared memory", False, f"{shm_dir}: {exc}",
                     f"mount a tmpfs on {shm_dir} (docker: --shm-size=2g) or pass shm_dir=")
    need = frame_bytes * FRAMES_HELD
    found = (f"{shm_dir}: {total / MiB:.0f} MiB, {free / MiB:.0f} MiB free; "
             f"{need / MiB:.0f} MiB needed for {frame_bytes / MiB:g} MiB frames")
    if total >= need and free >= need:
        return Check("shared memory", True, found)
    size = max(2048, -(-need * 2 // (1024 * MiB)) * 1024)
    fix = (f"give {shm_dir} at least {need / MiB:.0f} MiB: docker run --shm-size={size}m "
           f"(Kubernetes: an emptyDir with medium: Memory), or "
           f"sudo mount -o remount,size={size}M {shm_dir}")
    if total >= need:
        fix = f"free space in {shm_dir} (stale files of other programs?), or " + fix
    return Check("shared memory", False, found, fix)


def check_torch(device: str) -> list[Check]:
    try:
        import torch
    except ImportError as exc:
        return [Check("torch", False, f"not importable ({exc})",
                      "pip install torch (the build for your CUDA, or the CPU build)")]
    checks = [Check("torch", True, torch.__version__)]
    import torch.distributed as dist

    gloo = dist.is_available() and dist.is_gloo_available()  # a CUDA group's CPU side too
    checks.append(Check("gloo (CPU collectives)", gloo, "available" if gloo else "missing",
                        "" if gloo else "install a torch build with distributed support"))
    if device == "cpu":
        return checks
    if not torch.cuda.is_available():
        checks.append(Check("NCCL", False, "torch sees no CUDA device",
                            "install a CUDA build of torch and the NVIDIA driver, or "
                            "use --device cpu"))
        return checks
    try:
        version = ".".join(str(v) for v in torch.cuda.nccl.version())
        checks.append(Check("NCCL", dist.is_nccl_available(), version,
                            "" if dist.is_nccl_available() else "install a torch build with NCCL"))
    except Exception as exc:  # a torch without NCCL
        checks.append(Check("NCCL", False, f"unavailable ({exc})",
                            "install a torch build with NCCL"))
    return checks


def check_gpus(world_size: int, device: str) -> list[Check]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    shown = "<unset: every GPU>" if visible is None else repr(visible)
    if device == "cpu":
        return [Check("CUDA_VISIBLE_DEVICES", None, f"{shown} (not used on cpu)")]
    checks = []
    if visible is not None and not visible.strip():
        checks.append(Check("CUDA_VISIBLE_DEVICES", False, f"{shown}: hides every GPU",
                            "unset CUDA_VISIBLE_DEVICES, or list one GPU per rank"))
    else:
        checks.append(Check("CUDA_VISIBLE_DEVICES", True, shown))
    try:
        import torch

        count = torch.cuda.device_count()
    except ImportError:
        count = 0
    ok = count >= world_size
    fix = "" if ok else (
        f"lower --world-size to {count}, or make {world_size} GPUs visible "
        f"(CUDA_VISIBLE_DEVICES, the container's --gpus)" if count else
        "no GPU is visible: run with --device cpu, or make GPUs visible (an NVIDIA driver "
        "and a CUDA build of torch; CUDA_VISIBLE_DEVICES, the container's --gpus)")
    checks.append(Check("GPUs", ok, f"{count} visible, {world_size} needed (one per rank)",
                        fix))
    return checks


def limit_text(value: int) -> str:
    return "unlimited" if value == resource.RLIM_INFINITY else str(value)


def check_limits(device: str, world_size: int) -> list[Check]:
    """The open files limit (room for world_size ranks in this process, and at least
    MIN_OPEN_FILES for each rank's own model) and the locked memory limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    _, used, allowed = open_files.room()
    files_ok = soft == resource.RLIM_INFINITY or (soft >= MIN_OPEN_FILES and
                                                  (allowed or 0) >= world_size)
    enough = max(4096, MIN_OPEN_FILES, used + open_files.needed(world_size))
    room = "any number of" if allowed is None else str(allowed)
    checks = [Check("open files limit", files_ok,
                    f"{limit_text(soft)} (hard {limit_text(hard)}); {used} in use, room for "
                    f"{room} ranks ({world_size} asked)",
                    "" if files_ok else f"ulimit -n {enough} (docker: --ulimit nofile=65536)")]
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    found = f"{limit_text(soft)} bytes (hard {limit_text(hard)})"
    if device == "cpu":
        checks.append(Check("locked memory limit", None, f"{found} (matters for NCCL only)"))
    else:
        ok = soft == resource.RLIM_INFINITY or soft >= MIN_LOCKED_CUDA
        checks.append(Check("locked memory limit", ok, found, "" if ok else
                            "ulimit -l unlimited (docker: --ulimit memlock=-1): NCCL pins "
                            "host memory"))
    return checks


def check_cores(world_size: int, device: str) -> Check:
    """A core per rank on the CPU: ranks that share cores start slowly and answer slowly.
    On CUDA the GPUs compute, so the count is information only."""
    cores = usable_cores()
    found = f"{cores} usable by this process, for {world_size} rank{'s' * (world_size != 1)}"
    if device != "cpu":
        return Check("CPU cores", None, f"{found} (they compute on GPUs)")
    if cores >= world_size:
        return Check("CPU cores", True, f"{found} on cpu: a core per rank")
    return Check("CPU cores", False, f"{found} on cpu: they share the cores (a slow start, "
                 f"slow calls)", f"lower --world-size to {cores}, or run the ranks on GPUs "
                 f"(--device cuda)")


def check_pidfd() -> Check:
    try:
        fd = os.pidfd_open(os.getpid())
    except (AttributeError, OSError) as exc:
        return Check("pidfd", False, f"unavailable ({exc})",
                     "Linux 5.3+ and Python 3.9+: without pidfds a rank's death is "
                     "noticed by polling")
    os.close(fd)
    return Check("pidfd", True, "os.pidfd_open works (deaths noticed at once)")


def smoke(world_size: int, device: str, frame_bytes: int) -> Check:
    from .runner import DistributedRunner

    began = time.monotonic()
    try:
        with DistributedRunner(SmokeWorker, world_size=world_size, device=device,
                               call_timeout=60.0, start_timeout=300.0) as runner:
            answer = runner.generate(frame_bytes)
            frame = answer["frame"]
            want = world_size * (world_size + 1) / 2
            if answer["sum"] != want or frame.nbytes != frame_bytes or \
                    frame[0] != world_size % 251 or frame[-1] != world_size % 251:
                return Check("smoke run", False, f"wrong answer: sum {answer['sum']}, want "
                             f"{want}", "report this as a bug of reactor_dist")
            del answer, frame
    except Exception as exc:
        return Check("smoke run", False, f"{type(exc).__name__}: {str(exc)[:300]}",
                     "fix the checks above first; the error names the failing rank")
    steps = "torch group, all_reduce and a" if world_size > 1 else "no torch group (one rank), a"
    return Check("smoke run", True,
                 f"{world_size} rank{'s' if world_size > 1 else ''} on {device}: {steps} "
                 f"{frame_bytes / MiB:g} MiB frame back in {time.monotonic() - began:.1f} s")


def run_checks(world_size: int, device: str, frame_bytes: int = FRAME_BYTES,
               shm_dir: str = segments.DEFAULT_DIR, smoke_run: bool = True) -> list[Check]:
    checks = [check_shm(shm_dir, frame_bytes)]
    checks += check_gpus(world_size, device)
    checks += check_torch(device)
    checks += check_limits(device, world_size)
    checks += [check_cores(world_size, device), check_pidfd()]
    if smoke_run:
        checks.append(smoke(world_size, device, frame_bytes))
    return checks


def marks() -> tuple[str, str, str]:
    encoding = getattr(sys.stdout, "encoding", None) or "ascii"
    try:
        "✓✗".encode(encoding)
        return "✓", "✗", "·"
    except (UnicodeEncodeError, LookupError):
        return "ok", "X", "-"


def table(checks: list[Check]) -> str:
    good, bad, info = marks()
    width = max(len(c.name) for c in checks)
    lines = []
    for c in checks:
        mark = info if c.ok is None else good if c.ok else bad
        lines.append(f"{mark} {c.name.ljust(width)}  {c.found}")
        if c.ok is False:
            lines.append(f"  {' ' * width}  fix: {c.fix}")
    failed = sum(c.ok is False for c in checks)
    lines.append(f"{failed} check{'s' if failed != 1 else ''} failed" if failed
                 else "all checks passed")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="reactor-dist doctor",
        description="Check that this machine can run a DistributedRunner, then run one.")
    parser.add_argument("--world-size", type=int, default=None,
                        help="ranks to check for (default: the visible GPUs, else 2)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto (the default, as the runner's): cuda if torch sees a "
                        "GPU, else cpu")
    parser.add_argument("--frame-mb", type=float, default=FRAME_BYTES / MiB,
                        help="the size of the frames the application returns (MiB)")
    parser.add_argument("--shm-dir", default=segments.DEFAULT_DIR)
    parser.add_argument("--no-smoke", action="store_true", help="skip the smoke run")
    args = parser.parse_args(argv)
    device = device_kind("auto") if args.device == "auto" else args.device
    world_size = args.world_size
    if world_size is None:
        gpus = visible_gpus() if device == "cuda" else 0
        world_size = gpus or 2
    if world_size < 1:
        parser.error("--world-size must be at least 1")
    chosen = "" if args.device != "auto" else " (--device auto: torch sees " + \
        ("a CUDA device)" if device == "cuda" else "no CUDA device)")
    print(f"reactor-dist doctor: world_size={world_size}, device={device}{chosen}")
    checks = run_checks(world_size, device, int(args.frame_mb * MiB), args.shm_dir,
                        not args.no_smoke)
    print(table(checks))
    return 1 if any(c.ok is False for c in checks) else 0


def visible_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0
