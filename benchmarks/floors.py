"""This machine's floors, measured in the same run as everything else: what no runner
of this design can beat, so every figure is read as a multiple of them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import zmq

from benchmarks.baselines.procs import child_env, stop_processes
from benchmarks.stats import Stats, summarize
from benchmarks.zmq_peer import CMD, REPLY, STOP, pad


class ZmqFloor:
    """Raw PUB->SUB fan-out plus PUSH->PULL gather of ~100-byte headers over ipc://,
    with one peer process per rank: the transport under one empty ``generate()``.
    ``generate`` has a pool's signature so it is timed like every implementation."""

    name = "floor"

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.tmp = tempfile.mkdtemp(prefix=f"rdbench-{os.getpid()}-zmq-")
        self.ctx = zmq.Context()
        self.pub, self.pull = self.ctx.socket(zmq.PUB), self.ctx.socket(zmq.PULL)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pull.setsockopt(zmq.LINGER, 0)
        pub_addr, pull_addr = f"ipc://{self.tmp}/cmd", f"ipc://{self.tmp}/rep"
        self.pub.bind(pub_addr)
        self.pull.bind(pull_addr)
        self.seq = 0
        self.procs = [
            subprocess.Popen([sys.executable, "-m", "benchmarks.zmq_peer", pub_addr, pull_addr,
                              str(r)], env=child_env())
            for r in range(world_size)
        ]
        try:
            self._handshake()
        except BaseException:
            self.close()
            raise

    def _handshake(self) -> None:
        """Ping until every peer answered once: PUB drops what a slow joiner missed."""
        seen: set[int] = set()
        deadline = time.monotonic() + 30
        while len(seen) < self.world_size:
            if time.monotonic() > deadline:
                raise RuntimeError("zmq floor peers did not connect")
            self.seq += 1
            self.pub.send(pad(CMD.pack(self.seq)))
            while self.pull.poll(20):
                seen.add(REPLY.unpack_from(self.pull.recv())[1])

    def generate(self, inp: object = None) -> None:
        self.seq += 1
        self.pub.send(pad(CMD.pack(self.seq)))
        got = 0
        while got < self.world_size:
            s, _rank = REPLY.unpack_from(self.pull.recv())
            got += s == self.seq  # answers to older handshake pings are dropped

    def close(self) -> None:
        if self.ctx.closed:
            return
        self.pub.send(pad(CMD.pack(STOP)))
        stop_processes(self.procs)
        self.pub.close(0)
        self.pull.close(0)
        self.ctx.term()
        shutil.rmtree(self.tmp, ignore_errors=True)


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
