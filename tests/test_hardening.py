"""What another local user (or a planted file) must not be able to do to a runner.

Each test sets up what an attacker could set up on a shared machine (a module in
the working directory, entries in /dev/shm owned by a second user, names taken in
advance) and checks that the runner works and that nothing foreign is touched.
"""

from __future__ import annotations

import numpy as np
from sample_workers import Echo, FullArray

from reactor_dist import DistributedRunner

PLANTED = """
import os
with open({marker!r}, "a") as f:
    f.write(f"{{os.getpid()}} imported {name}\\n")
"""


def test_a_module_planted_in_the_working_directory_never_runs_in_a_rank(tmp_path, monkeypatch):
    plant = tmp_path / "cwd"
    plant.mkdir()
    marker = tmp_path / "marker"
    for name in ("argparse", "numpy", "msgpack", "zmq", "psutil"):
        (plant / f"{name}.py").write_text(PLANTED.format(marker=str(marker), name=name))
    monkeypatch.chdir(plant)
    with DistributedRunner(Echo, world_size=2, init_process_group=False, device="cpu") as runner:
        x = np.arange(1 << 18, dtype=np.float32)[::2]
        assert np.array_equal(runner.generate(x), x)
        assert runner.generate(FullArray([4 << 20])).nbytes == 4 << 20
    assert not marker.exists(), marker.read_text()
