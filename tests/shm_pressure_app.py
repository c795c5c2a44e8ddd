"""Run by tests/test_shm_pressure.py inside a private mount namespace whose 64 MiB tmpfs
is the runner's shm_dir: ``python shm_pressure_app.py SCENARIO DIR``; prints one
result line per step, which the test compares exactly."""

from __future__ import annotations

import asyncio
import os
import sys
import time

import numpy as np
from stream_workers import Frames

from reactor_dist import DistributedRunner, SharedMemoryExhausted
from reactor_dist.shm.ledger import IDLE_RETURN

MB16 = 16_000_000


def free_mib(directory: str) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize >> 20


def dropped_stream(runner: DistributedRunner, n: int) -> str:
    """Each item checked, then dropped (the loop variable is the only reference)."""
    seen = 0
    for item in runner.stream({"n": n, "size": MB16}):
        assert item.nbytes == MB16 and item[0] == seen % 256 and item[-1] == seen % 256
        seen += 1
        del item
    return f"stream {seen} of {n}"


def held_stream(runner: DistributedRunner, n: int) -> str:
    """Every item held to the end, then all dropped: rank 0 made ``n`` segments."""
    held = list(runner.stream({"n": n, "size": MB16}))
    return f"held {len(held)} of {n}"


async def dropped_astream(runner: DistributedRunner, n: int) -> str:
    seen = 0
    async for item in runner.astream({"n": n, "size": MB16}):
        assert item[0] == seen % 256
        seen += 1
        del item
    return f"astream {seen} of {n}"


def main(scenario: str, directory: str) -> None:
    with DistributedRunner(Frames, world_size=2, init_process_group=False, device="cpu",
                           shm_dir=directory) as runner:
        if scenario == "stream":
            print(dropped_stream(runner, 16))
            print(asyncio.run(dropped_astream(runner, 16)))
            print(dropped_stream(runner, 16))
        elif scenario == "input-after-stream":
            print(held_stream(runner, 4))  # rank 0's pool: all 64 MiB, kept warm
            result = runner.generate({"n": 1, "size": 8, "pad": np.ones(MB16, np.uint8)})
            print("16 MB input", result[0].tolist())
        elif scenario == "idle":
            print(held_stream(runner, 4))
            print("free after the stream", free_mib(directory))
            time.sleep(IDLE_RETURN * 2)
            print("free after idling", free_mib(directory))
        elif scenario == "truly-short":
            try:
                held = list(runner.stream({"n": 16, "size": MB16}))
            except SharedMemoryExhausted as exc:
                print("refused", str(exc).split(":")[0], "--shm-size" in str(exc))
            else:
                print("held", len(held))
            print("healthy", runner.healthy)
            print(dropped_stream(runner, 8))
    print("left", sorted(os.listdir(directory)))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
