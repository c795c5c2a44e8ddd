"""This machine's floors, measured in the same run as everything else: what no runner
of this design can beat, so every figure is read as a multiple of them."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import zmq

from benchmarks.baselines.procs import child_env, stop_processes
from benchmarks.stats import Stats, summarize, time_calls
from benchmarks.zmq_peer import CMD, REPLY, STOP, pad


def zmq_round_trip(world_size: int, *, n: int, warmup: int) -> Stats:
    """Raw PUB->SUB fan-out plus PUSH->PULL gather of ~100-byte headers over ipc://,
    with one peer process per rank: the transport under one empty ``generate()``."""
    tmp = tempfile.mkdtemp(prefix="rdbench-zmq-")
    ctx = zmq.Context()
    pub, pull = ctx.socket(zmq.PUB), ctx.socket(zmq.PULL)
    pub.setsockopt(zmq.LINGER, 0)
    pull.setsockopt(zmq.LINGER, 0)
    pub_addr, pull_addr = f"ipc://{tmp}/cmd", f"ipc://{tmp}/rep"
    pub.bind(pub_addr)
    pull.bind(pull_addr)
    procs = [
        subprocess.Popen([sys.executable, "-m", "benchmarks.zmq_peer", pub_addr, pull_addr,
                          str(r)], env=child_env())
        for r in range(world_size)
    ]
    seq = 0

    def call() -> None:
        nonlocal seq
        seq += 1
        pub.send(pad(CMD.pack(seq)))
        got = 0
        while got < world_size:
            s, _rank = REPLY.unpack_from(pull.recv())
            got += s == seq  # answers to older handshake pings are dropped, as a runner must

    try:
        # Handshake against the slow joiner: ping until every peer has answered once.
        seen: set[int] = set()
        deadline = time.monotonic() + 30
        while len(seen) < world_size:
            if time.monotonic() > deadline:
                raise RuntimeError("zmq floor peers did not connect")
            seq += 1
            pub.send(pad(CMD.pack(seq)))
            while pull.poll(20):
                seen.add(REPLY.unpack_from(pull.recv())[1])
        return time_calls(call, n=n, warmup=warmup)
    finally:
        pub.send(pad(CMD.pack(STOP)))
        stop_processes(procs)
        pub.close(0)
        pull.close(0)
        ctx.term()
        shutil.rmtree(tmp, ignore_errors=True)


def warm_copy(nbytes: int, *, n: int) -> Stats:
    """One ``np.copyto`` of ``nbytes`` into memory that is already faulted in."""
    src = np.full(nbytes, 1, np.uint8)
    dst = np.full(nbytes, 2, np.uint8)
    return time_calls(lambda: np.copyto(dst, src), n=n, warmup=2)


def bare_torch_imports(count: int) -> float:
    """Seconds for ``count`` parallel ``python -c "import torch"`` to all finish: the
    least a start-up of that many torch workers can take on these cores."""
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", "import torch"]) for _ in range(count)]
    for p in procs:
        p.wait()
    return time.perf_counter() - t0


def bare_torch_import_stats(count: int, trials: int) -> Stats:
    return summarize([bare_torch_imports(count) for _ in range(trials)])
