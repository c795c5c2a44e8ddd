"""``python -m benchmarks.recorder_cost [--runs N] [--calls N]``: what torch's flight
recorder (on by default in torch 2.13, read at a timeout:
:mod:`reactor_dist.rank.flight_recorder`) costs a gloo ``all_reduce`` of one float.

Each run is a fresh process with a gloo group of one rank on 127.0.0.1 that times
``--calls`` all_reduce calls (the best of 5 loops), with the recorder at torch's default
size (on: ``TORCH_FR_BUFFER_SIZE`` unset) or 0 (off, as ``record_collectives=False``
sets it); runs alternate, the order flipping every pair, and the
medians are compared.  It asserts nothing; it also prints the entries the recorder held.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys

from reactor_dist.wire.protocol import RECORDER_SIZE_ENV

ONE_RUN = r"""
import os, pickle, sys, time
import torch, torch.distributed as dist
from torch._C import _distributed_c10d as c10d
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0,
                        world_size=1)
x = torch.ones(1)
calls = int(sys.argv[2])
for _ in range(calls // 10):
    dist.all_reduce(x)
best = min(
    (lambda t0: (time.perf_counter() - t0) / calls)(
        [time.perf_counter(), [dist.all_reduce(x) for _ in range(calls)]][0])
    for _ in range(5))
entries = len(pickle.loads(c10d._dump_fr_trace(True, False, False)).get("entries", []))
print(best, entries)
dist.destroy_process_group()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_run(on: bool, calls: int) -> tuple[float, int]:
    env = {k: v for k, v in os.environ.items() if k not in RECORDER_SIZE_ENV}
    if not on:
        env[RECORDER_SIZE_ENV[0]] = "0"
    out = subprocess.run([sys.executable, "-c", ONE_RUN, str(free_port()), str(calls)],
                         env=env, capture_output=True, text=True, check=True, timeout=300)
    best, entries = out.stdout.split()
    return float(best), int(entries)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.recorder_cost",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=6, help="runs of each, alternating")
    ap.add_argument("--calls", type=int, default=20000, help="all_reduce calls per loop")
    args = ap.parse_args()
    times: dict[bool, list[float]] = {True: [], False: []}
    held: dict[bool, int] = {}
    for i in range(args.runs):
        for on in ((True, False) if i % 2 == 0 else (False, True)):
            best, held[on] = one_run(on, args.calls)
            times[on].append(best)
    on, off = statistics.median(times[True]), statistics.median(times[False])
    print(f"all_reduce of one float, gloo, 1 rank: recorder on {on * 1e6:.2f} µs, off "
          f"{off * 1e6:.2f} µs ({(on - off) * 1e6:+.2f} µs, medians of {args.runs} runs "
          f"each); entries held: on {held[True]}, off {held[False]}")


if __name__ == "__main__":
    main()
