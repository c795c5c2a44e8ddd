"""Shared fixtures: every test must leave no process, /dev/shm entry or ipc directory."""

from __future__ import annotations

import glob
import os
import tempfile
import time

import psutil
import pytest

from reactor_dist import shm


def our_shm_entries() -> set[str]:
    prefix = shm.owner_prefix() + "."
    return {n for n in os.listdir(shm.DEFAULT_DIR) if n.startswith(prefix)}


def ipc_dirs() -> set[str]:
    """This process's runners' private directories (other processes may run runners too)."""
    pattern = f"reactor-dist-{os.getpid()}-*"
    return set(glob.glob(os.path.join(tempfile.gettempdir(), pattern))) | set(
        glob.glob(os.path.join("/tmp", pattern)))


def live_descendants() -> list[psutil.Process]:
    procs = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                procs.append(p)
        except psutil.NoSuchProcess:
            pass
    return procs


def wait_gone(pids, timeout: float = 3.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in pids if psutil.pid_exists(p) and
                 psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
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
    before_procs = {p.pid for p in live_descendants()}
    before_dirs = ipc_dirs()
    yield
    left = [p for p in live_descendants() if p.pid not in before_procs]
    alive = wait_gone([p.pid for p in left], timeout=3.0)
    assert not alive, f"processes left behind: {[(p, psutil.Process(p).cmdline()) for p in alive]}"
    assert our_shm_entries() == set(), f"/dev/shm entries left: {our_shm_entries()}"
    assert ipc_dirs() - before_dirs == set(), f"ipc dirs left: {ipc_dirs() - before_dirs}"


@pytest.fixture
def log_dir(tmp_path):
    path = tmp_path / "logs"
    path.mkdir()
    return str(path)
