"""The application of test_join_torchrun.py, run in a network namespace of its own whose
one interface is loopback (``unshare --user --map-root-user --net``: torchrun's c10d
store listens on every address of the machine, here that is 127.0.0.1 alone).

It starts a runner with placement=External, then two torchrun "nodes" (``--nnodes=2``,
``--node-rank=0/1``, c10d rendezvous on 127.0.0.1) of two ranks each, as a cluster's
job script would, and prints one JSON line per step; the test reads them, then kills
this process and checks that torchrun and every rank end by themselves.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)
sys.path[:0] = [TESTS, REPO]

import numpy as np  # noqa: E402
import psutil  # noqa: E402
from join_workers import Frames  # noqa: E402
from probe import Probe  # noqa: E402
from restart_workers import Pid  # noqa: E402

from reactor_dist import DistributedRunner, External, WorkerCrashed  # noqa: E402
from reactor_dist.wire.protocol import JOIN_SECRET_ENV  # noqa: E402

SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1


def loopback_up() -> None:
    """A new network namespace's loopback starts down."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sh22x", b"lo", 0)
        flags = struct.unpack("16sh22x", fcntl.ioctl(s, SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sh22x", b"lo", flags | IFF_UP))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def say(**what) -> None:
    print(json.dumps(what), flush=True)


def torchrun(node: int, join: list[str], rendezvous: int, out: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2",
         f"--node-rank={node}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{rendezvous}",
         "--rdzv-id=reactor-dist-test", "--local-addr=127.0.0.1", "--max-restarts=1",
         "--monitor-interval=0.1", "-m", "reactor_dist.rank", *join],
        env={**os.environ, "PYTHONPATH": os.pathsep.join([TESTS, REPO])},
        stdout=open(out, "wb"), stderr=subprocess.STDOUT,  # noqa: SIM115
        start_new_session=True)  # the cluster's launcher, not a child group of ours


def by_hand(join: list[str], rank: int, env: dict[str, str] | None = None) -> tuple[int, str]:
    done = subprocess.run(
        [sys.executable, "-m", "reactor_dist.rank", *join, "--rank", str(rank),
         "--world-size", "4"], capture_output=True, timeout=120,
        env=env or {**os.environ, "PYTHONPATH": os.pathsep.join([TESTS, REPO])})
    return done.returncode, done.stderr.decode(errors="replace")


def main(out_dir: str) -> None:
    loopback_up()
    secret = os.path.join(out_dir, "secret")
    runner = DistributedRunner(Frames, world_size=4, device="cpu", start_timeout=240,
                               call_timeout=60, shutdown_grace=2.0,
                               placement=External(port=free_port(), secret_file=secret))
    starting = threading.Thread(target=runner.start)
    starting.start()
    while not runner.join_command:
        time.sleep(0.02)
    join = runner.join_command.split()[1:]
    rendezvous = free_port()
    launchers = [torchrun(node, join, rendezvous, os.path.join(out_dir, f"node{node}.log"))
                 for node in (0, 1)]
    say(step="launched", launchers=[p.pid for p in launchers])
    starting.join()
    frame = np.arange(512 * 1024, dtype=np.uint8).reshape(512, 1024)
    out = runner.generate(frame)
    say(step="generate", frame_ok=bool(np.array_equal(out["frame"], frame[::-1] * 2)),
        sum=out["sum"], expected=4 * float(frame.sum(dtype=np.float64)),
        shared=Probe(runner).shares_memory)

    pids = [pid for pid, _, _ in runner.generate(Pid())]
    wrong = {**os.environ, "PYTHONPATH": os.pathsep.join([TESTS, REPO]),
             JOIN_SECRET_ENV: open(secret).read()[:41] + "A" * 40}
    no_secret = join[:join.index("--secret-file")]
    refused = {"wrong secret": by_hand(no_secret, 1, wrong), "taken": by_hand(join, 2)}
    say(step="refused", codes=[code for code, _ in refused.values()],
        said=[text.strip().splitlines()[-1] for _, text in refused.values()],
        same=[pid for pid, _, _ in runner.generate(Pid())] == pids)

    victim = pids[3]
    began = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    error = ""
    try:
        while True:
            runner.generate(1.0)
    except WorkerCrashed as exc:
        error = str(exc)
    say(step="crashed", seconds=time.monotonic() - began, error=error)

    # torchrun's agents restart every worker of the job (its elastic agent's rule):
    # restart() waits for the ranks whose joiners ended, and keeps any still live.
    deadline = time.monotonic() + 120
    while any(info.alive for info in runner.ranks) and time.monotonic() < deadline:
        time.sleep(0.05)
    runner.restart()
    after = runner.generate(Pid())
    say(step="restarted", answer=runner.generate(2.0), loads=[n for _, n, _ in after],
        new=[pid not in pids for pid, _, _ in after])

    ranks = [info.pid for info in runner.ranks]
    joiners = [c.pid for launcher in launchers
               for c in psutil.Process(launcher.pid).children(recursive=True)]
    say(step="ready", launchers=[p.pid for p in launchers], joiners=joiners, ranks=ranks)
    time.sleep(600)  # the test kills us here


if __name__ == "__main__":
    main(sys.argv[1])
