"""The device check for a machine with CUDA: `make gpu-check` (world_size 1 on one GPU).

Runs the GPU-marked tests, then times on CUDA what matters for a video model: start-up
with the nccl-capable device binding, an empty call, and a 97 MB frame tensor on the GPU
returned (a) as ``tensor.cpu().numpy()`` and (b) copied into ``shared_empty`` — next to
the floor, one ``tensor.cpu()`` copy in this process. Prints one table; asserts nothing.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

import numpy as np

from reactor_dist import DistributedRunner, DistributedWorker

SHAPE = (81, 480, 832, 3)  # 97 MB of uint8 RGB frames


class GpuFrames(DistributedWorker):
    def load(self) -> None:
        import torch

        self.torch = torch
        self.frames = torch.randint(0, 255, SHAPE, dtype=torch.uint8, device=self.device)

    def generate(self, how, /):
        if how == "plain":
            return self.frames.cpu().numpy()
        if how == "shared":
            out = self.shared_empty(SHAPE, np.uint8)
            self.torch.from_numpy(out).copy_(self.frames)
            return out
        return None


def timed(fn, trials: int) -> tuple[float, float]:
    times = []
    for _ in range(trials):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
        del result
    times.sort()
    return statistics.median(times), times[int(len(times) * 0.9)]


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device visible; nothing to check here")
        return 0
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu",
                            "tests/test_devices.py"])
    rows = []
    start = time.perf_counter()
    with DistributedRunner(GpuFrames, world_size=1, device="cuda") as runner:
        rows.append(("start() to ready", time.perf_counter() - start, None))
        for _ in range(20):
            runner.generate("shared")
        rows.append(("empty call", *timed(lambda: runner.generate(None), 500)))
        rows.append(("97 MB frames, .cpu().numpy()", *timed(lambda: runner.generate("plain"), 30)))
        rows.append(("97 MB frames, shared_empty", *timed(lambda: runner.generate("shared"), 30)))
    frames = torch.randint(0, 255, SHAPE, dtype=torch.uint8, device="cuda")
    host = torch.empty(SHAPE, dtype=torch.uint8)
    rows.append(("floor: one device-to-host copy", *timed(lambda: host.copy_(frames), 30)))
    print(f"\n{torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    print(f"{'case':<34} {'median':>10} {'p90':>10}")
    for name, median, p90 in rows:
        p90_text = f"{p90 * 1e3:>8.2f}ms" if p90 is not None else " " * 10
        print(f"{name:<34} {median * 1e3:>8.2f}ms {p90_text}")
    return tests.returncode


if __name__ == "__main__":
    sys.exit(main())
