"""Shared fixtures: every test must leave no process, /dev/shm entry or ipc directory."""

from __future__ import annotations

import glob
import os
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import psutil
import pytest

from reactor_dist import DistributedRunner
from reactor_dist.placement.template import Template
from reactor_dist.shm import segments

# Every process the tests start inherits this (ranks, their children, apps in subprocesses):
# it finds the ones that left the process tree (setsid, reparented to init).
SESSION_ENV = "REACTOR_DIST_TEST_SESSION"
os.environ[SESSION_ENV] = f"{os.getpid()}-{os.urandom(8).hex()}"
# numpy's OpenBLAS starts a thread per core as it is imported, which costs each rank
# (every test starts two or more) about 0.08 s of CPU of its ~0.3 s; the tests compute
# nothing with BLAS, and make test runs them side by side on two cores.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# Ray (tests/test_ray.py) reads these as it is imported: every simulated node on
# 127.0.0.1, nothing reported to an outside server.
os.environ.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0")
# A command that a non-interactive shell starts in the background (`make test &`, a loop
# under `nohup`) inherits SIGINT ignored, and so does every process it starts: Python
# then installs no KeyboardInterrupt handler, and the Ctrl-C tests see their SIGINT
# vanish (the "Ctrl-C lost under load" of issue 29: the runs under load were started so).
# The tests are about what a Ctrl-C does to an application that takes it, so this
# process takes it, and its children (xdist's workers, the apps in a terminal) inherit
# the default disposition. tests/test_faults.py shows it (…started_with_it_ignored).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# The modules whose tests take longest (a restart forms a new torch group; the docs'
# examples and the video model start fresh interpreters that import torch):
# first in the run, so that with the tests side by side (make test) none of them is
# left to run at the end with the other processes idle.
LONGEST_FIRST = ("test_restart.py",
                 "test_docs_examples.py", "test_video_app.py", "test_workers.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def position(item: pytest.Item) -> int:
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=position)  # stable: each module's own order is kept


def session_processes() -> set[int]:
    """Live processes (but this one) that carry this test session's SESSION_ENV."""
    needle = f"{SESSION_ENV}={os.environ[SESSION_ENV]}".encode() + b"\0"
    found = set()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle in f.read():
                    found.add(int(name))
        except OSError:
            pass
    return set(wait_gone(found, timeout=0)) - templates()


def templates() -> set[int]:
    """The rank templates of this process (reactor_dist.placement.template): they serve every runner
    of the process and live as long as it does, so no test leaves them behind."""
    return Template.pids()


def our_shm_entries() -> set[str]:
    prefix = segments.owner_prefix() + "."
    return {n for n in os.listdir(segments.DEFAULT_DIR) if n.startswith(prefix)}


def ipc_dirs() -> set[str]:
    """This process's runners' private directories (other processes may run runners too)."""
    pattern = f"reactor-dist-{os.getpid()}-*"
    return set(glob.glob(os.path.join(tempfile.gettempdir(), pattern))) | set(
        glob.glob(os.path.join("/tmp", pattern)))


def live_descendants() -> list[psutil.Process]:
    procs = []
    own = templates()
    for p in psutil.Process().children(recursive=True):
        if p.pid in own:
            continue
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                procs.append(p)
        except psutil.NoSuchProcess:
            pass
    return procs


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def cmdline(pid: int) -> list[str]:
    try:
        return psutil.Process(pid).cmdline()
    except psutil.Error:
        return []


def wait_gone(pids, timeout: float = 3.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in pids if running(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.02)


def segment_of(address: int) -> str | None:
    """The /dev/shm file this process maps at ``address`` (from /proc/self/maps)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= address < hi and len(parts) >= 6:
                return parts[5]
    return None


@pytest.fixture(autouse=True)
def nothing_left_behind():
    """After each test: no new child process, no /dev/shm entry of ours, no ipc dir."""
    before_procs = {p.pid for p in live_descendants()} | session_processes()
    before_dirs = ipc_dirs()
    yield
    left = {p.pid for p in live_descendants()} | session_processes()
    alive = wait_gone(left - before_procs, timeout=3.0)
    assert not alive, f"processes left behind: {[(p, cmdline(p)) for p in alive]}"
    assert our_shm_entries() == set(), f"/dev/shm entries left: {our_shm_entries()}"
    assert ipc_dirs() - before_dirs == set(), f"ipc dirs left: {ipc_dirs() - before_dirs}"


@pytest.fixture
def log_dir(tmp_path):
    path = tmp_path / "logs"
    path.mkdir()
    return str(path)


@pytest.fixture
def runner_for() -> Iterator[Callable[..., DistributedRunner]]:
    """Runners with the tests' defaults: ``runner_for(worker, world_size=2, **options)``
    is a new (not started) DistributedRunner of ``worker`` on ``device="cpu"``, with no
    torch group (``init_process_group=False``) and a 20 s ``call_timeout`` unless
    ``options`` say otherwise; used as ``with runner_for(Echo) as runner:``.  A runner it
    made that the test left running is shut down after the test (before the check that
    nothing was left behind)."""
    made: list[DistributedRunner] = []

    def make(worker: type, world_size: int = 2, **options: Any) -> DistributedRunner:
        options.setdefault("device", "cpu")
        options.setdefault("init_process_group", False)
        options.setdefault("call_timeout", 20.0)
        runner = DistributedRunner(worker, world_size=world_size, **options)
        made.append(runner)
        return runner

    yield make
    for runner in made:
        runner.shutdown()
