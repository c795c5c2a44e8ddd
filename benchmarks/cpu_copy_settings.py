"""``python -m benchmarks.cpu_copy_settings [--calls N] [--rounds R]``: what a fresh 97 MB
CPU buffer costs a rank under each allocator setting (issue 43, item 5).

``tensor.cpu()`` of a CUDA tensor allocates a new pageable buffer on every call and
copies into it.  97 MB is above glibc's largest mmap threshold (32 MB), so each call
maps fresh pages and takes ~24,000 first-touch page faults before the copy.  The same
allocation is measurable on the CPU: ``torch.empty(n, uint8).copy_(src)``, which is
what ``.cpu()`` does on the host side.  Each setting runs in a fresh interpreter of its
own (the variables are read by torch and glibc in that process), all of them started
together and timed in alternating blocks; the floor is the same copy into a buffer
reused from call to call (its pages already there).

Reported per setting: the median ms per 97 MB allocation + copy, the page faults per
call (``ru_minflt``), and the resident memory after the warm-up, after the first block
and after the last one: a setting whose memory grows from block to block is not bounded,
and one that holds more than the others after the warm-up keeps that much per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

NBYTES = 81 * 480 * 832 * 3  # 97 MB: one video step of uint8 RGB frames
# glibc's malloc variables (man mallopt): no mmap for large blocks (the heap is reused
# from call to call), and freed memory kept (the trim threshold above any peak).
HEAP_REUSE = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}
# torch's CPU allocator: blocks of >= 2 MB aligned to 2 MB and madvise(MADV_HUGEPAGE)d,
# so that a first touch faults in a 2 MB page, not 512 pages of 4 KiB.
HUGE_PAGES = {"THP_MEM_ALLOC_ENABLE": "1"}
SETTINGS: dict[str, dict[str, str]] = {
    "default": {},
    "THP_MEM_ALLOC_ENABLE=1": HUGE_PAGES,
    "MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1 TiB": HEAP_REUSE,
}
COMPARED = frozenset(k for env in SETTINGS.values() for k in env)
FLOOR = "floor: copy into a reused buffer"
THP_PATH = "/sys/kernel/mm/transparent_hugepage/enabled"


@dataclass
class Measured:
    """One setting's samples (seconds per call) and what its process reported."""

    seconds: list[float]
    faults_per_call: float
    rss_warm: int  # bytes resident after the untimed warm-up calls
    rss_first: int  # after the first timed block
    rss_last: int  # after the last one

    @property
    def median_ms(self) -> float:
        return statistics.median(self.seconds) * 1e3


# -- the child: one setting, one process -----------------------------------------------------
def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(floor: bool) -> None:
    """Answer each line ``N`` on stdin with the seconds of N calls, their page faults and
    the resident bytes after them (one JSON line); exit at end of input."""
    import torch

    src = torch.ones(NBYTES, dtype=torch.uint8)
    reused = torch.empty(NBYTES, dtype=torch.uint8)
    reused.copy_(src)

    def call():
        if floor:
            return reused.copy_(src)
        return torch.empty(NBYTES, dtype=torch.uint8).copy_(src)

    for line in sys.stdin:
        seconds = []
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(int(line)):
            began = time.perf_counter()
            out = call()
            seconds.append(time.perf_counter() - began)
            del out
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        print(json.dumps({"seconds": seconds, "faults": faults, "rss": rss()}), flush=True)


# -- the parent ------------------------------------------------------------------------------
def start(name: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k not in COMPARED}
    env.update(SETTINGS.get(name, {}))
    args = [sys.executable, "-m", "benchmarks.cpu_copy_settings", "--child"]
    if name == FLOOR:
        args.append("--floor")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.Popen(args, env=env, cwd=root, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def ask(proc: subprocess.Popen[str], calls: int) -> dict:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(f"{calls}\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"a setting's process exited ({proc.wait()})")
    return json.loads(line)


def measure(calls: int = 120, rounds: int = 6, warmup: int = 5) -> dict[str, Measured]:
    """Every setting and the floor, each in a fresh process, timed in ``rounds``
    alternating blocks of ``calls // rounds`` calls after ``warmup`` untimed ones."""
    names = [*SETTINGS, FLOOR]
    procs = {name: start(name) for name in names}
    warm: dict[str, int] = {}
    out: dict[str, Measured] = {}
    try:
        for name, proc in procs.items():
            warm[name] = ask(proc, warmup)["rss"]
        size = max(1, calls // rounds)
        for r in range(rounds):
            for name in (names if r % 2 == 0 else names[::-1]):
                block = ask(procs[name], size)
                m = out.setdefault(name, Measured([], 0.0, warm[name], block["rss"], 0))
                m.seconds += block["seconds"]
                m.faults_per_call += block["faults"] / (size * rounds)
                m.rss_last = block["rss"]
    finally:
        for proc in procs.values():
            assert proc.stdin is not None
            proc.stdin.close()
        for proc in procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return out


def transparent_huge_pages() -> str:
    """The kernel's THP mode (the bracketed one), or why it is unknown."""
    try:
        with open(THP_PATH) as f:
            text = f.read()
    except OSError:
        return "unknown (no " + THP_PATH + ")"
    return text[text.find("[") + 1:text.find("]")] if "[" in text else text.strip()


def table(results: dict[str, Measured]) -> str:
    default = results["default"].median_ms
    lines = ["| setting | ms per 97 MB allocation + copy | vs default | page faults per "
             "call | RSS after the warm-up → the first block → the last |",
             "|---|---|---|---|---|"]
    for name, m in results.items():
        lines.append(f"| {name} | {m.median_ms:.2f} | {m.median_ms / default:.2f}× | "
                     f"{m.faults_per_call:,.0f} | {m.rss_warm >> 20} → {m.rss_first >> 20} "
                     f"→ {m.rss_last >> 20} MB |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.cpu_copy_settings",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=120, help="timed calls per setting")
    ap.add_argument("--rounds", type=int, default=6, help="alternating blocks")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--floor", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.floor)
        return 0
    print(f"transparent huge pages: {transparent_huge_pages()}; {args.calls} calls per "
          f"setting in {args.rounds} alternating blocks; medians")
    print(table(measure(args.calls, args.rounds)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
