"""How reactor_dist.wire.transfer.INLINE_LIMIT was chosen: echo latency of one buffer of each
size, all buffers inline (ZeroMQ frames) vs all through /dev/shm segments.

    .venv/bin/python -m benchmarks.inline_threshold

Below the crossover a frame copy is cheaper than a segment round trip; above it the
segment wins, and by far for large buffers (the frame path copies on every hop).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np

from reactor_dist import DistributedRunner, DistributedWorker

SIZES_KIB = (4, 16, 32, 64, 128, 256, 1024)


class Echo(DistributedWorker):
    def generate(self, value, /):
        return value


def measure() -> dict[int, float]:
    medians = {}
    with DistributedRunner(Echo, world_size=2, init_process_group=False, device="cpu") as runner:
        for kib in SIZES_KIB:
            payload = np.ones(kib * 1024, np.uint8)
            for _ in range(50):
                runner.generate(payload)
            times = []
            for _ in range(400):
                start = time.perf_counter()
                out = runner.generate(payload)
                times.append(time.perf_counter() - start)
                del out
            medians[kib] = sorted(times)[len(times) // 2] * 1e6
    return medians


def main() -> None:
    if "--child" in sys.argv:
        print(json.dumps(measure()))
        return
    rows = {}
    for label, limit in (("inline", str(1 << 40)), ("segment", "0")):
        env = dict(os.environ, REACTOR_DIST_INLINE_LIMIT=limit)
        out = subprocess.run([sys.executable, "-m", "benchmarks.inline_threshold", "--child"],
                             env=env, capture_output=True, text=True, check=True).stdout
        rows[label] = {int(k): v for k, v in json.loads(out).items()}
    print(f"{'size':>8} {'inline µs':>10} {'segment µs':>11}")
    for kib in SIZES_KIB:
        print(f"{kib:>6}Ki {rows['inline'][kib]:>10.0f} {rows['segment'][kib]:>11.0f}")


if __name__ == "__main__":
    main()
