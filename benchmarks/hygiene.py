"""A benchmark must leave the machine as it found it: no /dev/shm entry, no process."""

from __future__ import annotations

import gc
import os
import tempfile
import time

import psutil

SHM = "/dev/shm"


def shm_entries() -> set[str]:
    try:
        return set(os.listdir(SHM))
    except OSError:
        return set()


TMP_PREFIXES = ("rdbench-", "reactor-dist-")  # ours and the runner's private ipc dirs


def tmp_entries() -> set[str]:
    try:
        return {n for n in os.listdir(tempfile.gettempdir()) if n.startswith(TMP_PREFIXES)}
    except OSError:
        return set()


def snapshot() -> tuple[set[str], set[str]]:
    return shm_entries(), tmp_entries()


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


def check(before: tuple[set[str], set[str]], settle_s: float = 2.0) -> list[str]:
    """Problems found after the run (empty when clean); leftover processes are killed."""
    gc.collect()
    deadline = time.monotonic() + settle_s
    while True:  # shutdown paths may unlink a moment after they return
        new_shm = sorted(shm_entries() - before[0])
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
