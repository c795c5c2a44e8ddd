"""This machine's floors for transfers and start-up, measured in the same run as everything
else: what no runner of this design can beat, so every figure is read as a multiple of
them. The per-call floor (bare pyzmq echo peers) is ``raw_floor.RawFloor``."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np

from benchmarks.implementations.procs import stop_processes
from benchmarks.report.stats import Stats, summarize


class WarmCopy:
    """One ``np.copyto`` of ``nbytes`` into memory that is already faulted in: the least
    a caller can pay to get those bytes into memory it owns."""

    def __init__(self, nbytes: int) -> None:
        self.src = np.full(nbytes, 1, np.uint8)
        self.dst = np.full(nbytes, 2, np.uint8)

    def __call__(self) -> None:
        np.copyto(self.dst, self.src)


def bare_torch_imports(count: int) -> float:
    """Seconds until ``count`` parallel ``python -c "import torch"`` have all imported it
    (each says so on stdout; their exit is not counted, as start() does not wait for
    one): the least a start-up of that many torch workers can take on these cores."""
    code = "import sys, torch; sys.stdout.write('ok\\n'); sys.stdout.flush(); sys.stdin.read()"
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE) for _ in range(count)]
    try:
        for p in procs:
            assert p.stdout is not None
            if p.stdout.readline() != b"ok\n":
                raise RuntimeError("python -c 'import torch' failed")
        return time.perf_counter() - t0
    finally:
        for p in procs:
            assert p.stdin is not None and p.stdout is not None
            p.stdin.close()  # lets it exit
            p.stdout.close()
        stop_processes(procs)


def bare_torch_import_stats(count: int, trials: int) -> Stats:
    return summarize([bare_torch_imports(count) for _ in range(trials)])
