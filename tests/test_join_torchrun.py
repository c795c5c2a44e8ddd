"""The real torchrun (``python -m torch.distributed.run``) starts the ranks of a runner
with placement=External: two "nodes" as two torchrun invocations (``--nnodes=2``,
``--node-rank=0/1``, c10d rendezvous) of two ranks each, world size 4, gloo.

Everything runs in a network namespace whose one interface is loopback
(tests/torchrun_app.py), so that torchrun's own store, which listens on every
address of the machine, listens on 127.0.0.1 alone."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time

import pytest
from conftest import wait_gone

TESTS = os.path.dirname(os.path.abspath(__file__))
HOST = os.uname().nodename


class Lines:
    """The application's JSON lines, each awaited with a timeout."""

    def __init__(self, stream) -> None:
        self.found: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream) -> None:
        for line in stream:
            self.found.put(json.loads(line))
        self.found.put(None)

    def next(self, step: str, timeout: float = 300.0) -> dict:
        line = self.found.get(timeout=timeout)
        assert line is not None, f"the application ended before its {step!r} step"
        assert line["step"] == step
        return line


@pytest.mark.alone  # four ranks and two torchrun agents import torch on two cores
@pytest.mark.timeout(900)
def test_torchrun_starts_the_ranks_restarts_one_and_ends_with_the_application(tmp_path):
    app = subprocess.Popen(
        ["unshare", "--user", "--map-root-user", "--net", sys.executable,
         os.path.join(TESTS, "torchrun_app.py"), str(tmp_path)],
        stdout=subprocess.PIPE, stderr=open(tmp_path / "app.log", "wb"))  # noqa: SIM115
    lines = Lines(app.stdout)
    launchers: list[int] = []
    try:
        launchers = lines.next("launched")["launchers"]
        generated = lines.next("generate")
        assert generated["frame_ok"] and generated["sum"] == generated["expected"]
        assert generated["shared"]  # one machine: the frame went through /dev/shm

        refused = lines.next("refused")
        assert refused["codes"] == [2, 2]
        assert "refused this rank's join secret" in refused["said"][0]
        assert refused["said"][1].startswith("reactor-dist-rank: the runner refused rank 2: "
                                             f"rank 2 is taken: it joined from {HOST} (pid ")
        assert refused["same"]  # the four ranks carry on, the same processes

        crashed = lines.next("crashed")
        assert crashed["error"].startswith("rank 3 died ")
        assert f"on {HOST}) killed by SIGKILL" in crashed["error"]

        restarted = lines.next("restarted")
        assert restarted["answer"] == [8.0, 18.0, 28.0, 38.0]  # 10 * arange(4) + 4 * 2
        assert restarted["new"] == [True] * 4  # torchrun restarted every worker
        assert restarted["loads"] == [1] * 4

        ready = lines.next("ready")
        everything = ready["launchers"] + ready["joiners"] + ready["ranks"]
        assert wait_gone(everything, timeout=0) == everything
        app.kill()
        app.wait()
        began = time.monotonic()
        assert wait_gone(everything, timeout=15.0) == []  # the time is printed (-s)
        print(f"torchrun and every rank ended {time.monotonic() - began:.2f} s after the "
              f"application was killed")
        assert [n for n in os.listdir("/dev/shm") if n.startswith(f"rdist.{app.pid}.")] == []
    finally:
        app.kill()
        app.wait()
        for pid in wait_gone(launchers, timeout=15.0):  # only where a check above failed
            os.kill(pid, 9)
        for log in ("app.log", "node0.log", "node1.log"):
            path = tmp_path / log
            if path.exists():
                print(f"--- {log}\n{path.read_text(errors='replace')[-3000:]}")
