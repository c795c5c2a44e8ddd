"""A benchmark must leave the machine as it found it: no /dev/shm entry, no process."""

from __future__ import annotations

import gc
import os
import time

import psutil

SHM = "/dev/shm"


def shm_entries() -> set[str]:
    try:
        return set(os.listdir(SHM))
    except OSError:
        return set()


def leftover_children() -> list[psutil.Process]:
    """Live descendants of this process, minus multiprocessing's resource tracker (it
    lives until the interpreter exits, by design)."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            if any("resource_tracker" in part for part in p.cmdline()):
                continue
        except psutil.NoSuchProcess:
            continue
        out.append(p)
    return out


def check(before: set[str], settle_s: float = 2.0) -> list[str]:
    """Problems found after the run (empty when clean); leftover processes are killed."""
    gc.collect()
    deadline = time.monotonic() + settle_s
    while True:  # shutdown paths may unlink a moment after they return
        new = sorted(shm_entries() - before)
        kids = leftover_children()
        if (not new and not kids) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    problems = [f"/dev/shm entry left behind: {name}" for name in new]
    for p in kids:
        try:
            problems.append(f"process left behind: pid {p.pid} {' '.join(p.cmdline())[:120]}")
            p.kill()
        except psutil.NoSuchProcess:
            pass
    return problems
