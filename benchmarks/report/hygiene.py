"""A benchmark must leave the machine as it found it: no /dev/shm entry, no temporary
directory, no process. Other programs may run beside us (a test suite, another
benchmark), so only what this process made is counted."""

from __future__ import annotations

import gc
import os
import tempfile
import time
from pathlib import Path

import psutil

from reactor_dist.placement.template import Template

SHM = "/dev/shm"


def _tmp_prefixes() -> tuple[str, ...]:
    # Ours (failure pid files, raw floor, json baseline) and the runner's private ipc dirs;
    # both carry the pid of the process that made them.
    pid = os.getpid()
    return (f"rdbench-{pid}-", f"reactor-dist-{pid}-")


def shm_entries() -> set[str]:
    try:
        return set(os.listdir(SHM))
    except OSError:
        return set()


def tmp_entries() -> set[str]:
    try:
        return {n for n in os.listdir(tempfile.gettempdir()) if n.startswith(_tmp_prefixes())}
    except OSError:
        return set()


def snapshot() -> tuple[set[str], set[str]]:
    return shm_entries(), tmp_entries()


def _held_elsewhere(names: list[str]) -> set[str]:
    """Entries another live process maps or has open: theirs, not a leak of ours."""
    held: set[str] = set()
    me = os.getpid()
    for pid in psutil.pids():
        if pid == me:
            continue
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
            fds = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        for name in names:
            path = f"{SHM}/{name}"
            if path in maps or path in fds:
                held.add(name)
    return held


def _mine(new: list[str]) -> list[str]:
    """New entries held by no other live process: ours (a runner's segments, whatever
    their names, and multiprocessing's semaphores, which have random names). One that a
    leftover process of ours still holds is not counted here; that process is."""
    held = _held_elsewhere(new) if new else set()
    return [n for n in new if n not in held]


def leftover_children() -> list[psutil.Process]:
    """Live descendants of this process, minus multiprocessing's resource tracker and
    the rank templates (reactor_dist.placement.template): both live until the interpreter exits,
    by design."""
    out = []
    templates = Template.pids()
    for p in psutil.Process().children(recursive=True):
        if p.pid in templates:
            continue
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            if any("resource_tracker" in part for part in p.cmdline()):
                continue
        except psutil.NoSuchProcess:
            continue
        out.append(p)
    return out


def check(before: tuple[set[str], set[str]], settle_s: float = 2.0) -> list[str]:
    """Problems found after the run (empty when clean); leftover processes are killed."""
    gc.collect()
    deadline = time.monotonic() + settle_s
    while True:  # shutdown paths may unlink a moment after they return
        new_shm = _mine(sorted(shm_entries() - before[0]))
        new_tmp = sorted(tmp_entries() - before[1])
        kids = leftover_children()
        if (not new_shm and not new_tmp and not kids) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    problems = [f"/dev/shm entry left behind: {name}" for name in new_shm]
    problems += [f"temporary entry left behind: {tempfile.gettempdir()}/{n}" for n in new_tmp]
    for p in kids:
        try:
            problems.append(f"process left behind: pid {p.pid} {' '.join(p.cmdline())[:120]}")
            p.kill()
        except psutil.NoSuchProcess:
            pass
    return problems
