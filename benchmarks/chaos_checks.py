"""What ``make chaos`` (benchmarks/chaos.py) checks with, apart from the answers: which
errors the contract allows, the fault clock, the watchdog over every wait, what a runner
left behind (the checks of tests/conftest.py, by this process's names), and the table."""

from __future__ import annotations

import contextlib
import faulthandler
import glob
import itertools
import logging
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psutil

from benchmarks.chaos_workers import InjectedError
from reactor_dist import CallQueueFull, RankDesync, WorkerCrashed, WorkerTimeout
from reactor_dist.placement.template import Template
from reactor_dist.shm import segments
from reactor_dist.wire.protocol import IPC_DIR_PREFIX, MARK_ENV

# The RuntimeErrors the contract allows, by their words (docs/errors-and-recovery.md).
ALLOWED_RUNTIME = {
    "DistributedRunner is restarting": "RuntimeError: restarting",
    "DistributedRunner is unusable": "RuntimeError: unusable",
    "in flight when the runner was shut down": "RuntimeError: shut down",
    "in flight when runner.restart() was called": "RuntimeError: in flight at restart()",
}
DOCUMENTED = (WorkerCrashed, WorkerTimeout, RankDesync, CallQueueFull)
# Errors raised before a call is sent: its fault did not happen.
NOT_SENT = ("CallQueueFull", "RuntimeError: restarting", "RuntimeError: unusable")
# A fault every 1-4 s (--fault-every), of these kinds (weights; --faults picks some):
# signals from here, the rest in an input.
KINDS = {"sigkill": 1.0, "sigstop": 1.0, "raise_one": 1.5, "raise_all": 1.5, "hang": 0.7,
         "desync": 1.0, "exit": 1.0}


def classify(exc: BaseException, fault: dict | None) -> tuple[str, bool]:
    """A call's error as a table key, and whether the error contract allows it."""
    for cls in DOCUMENTED:
        if isinstance(exc, cls):
            return cls.__name__, True
    if isinstance(exc, InjectedError):  # only a call whose every rank raises it may get it
        if fault is not None and fault["means"] == "raise" and fault["rank"] == "all":
            return "InjectedError", True
        return "InjectedError (not raised by every rank)", False
    if type(exc) is RuntimeError:
        for words, key in ALLOWED_RUNTIME.items():
            if words in str(exc):
                return key, True
        return f"RuntimeError: {str(exc)[:60]}", False
    return f"{type(exc).__module__}.{type(exc).__qualname__}", False


def rank_pids() -> dict[int, int]:
    """This process's live ranks, rank -> pid (the ranks carry the runner's mark)."""
    found = {}
    for p in psutil.Process().children():
        with contextlib.suppress(psutil.Error, KeyError, ValueError):
            env = p.environ()
            if MARK_ENV in env and p.status() != psutil.STATUS_ZOMBIE:
                found[int(env["RANK"])] = p.pid
    return found


def signal_rank(pid: int, sig: int) -> None:
    """``sig`` to ``pid`` if it still is one of our ranks (never a reused pid)."""
    if pid in rank_pids().values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


class Faults:
    """One runner's fault clock: every 1-4 s a fault, a signal sent at once or an input
    fault for the next call made (``take``)."""

    def __init__(self, rng: random.Random, world_size: int, call_timeout: float,
                 counts: Any, kinds: list[str], every: tuple[float, float]) -> None:
        self.rng, self.world_size, self.call_timeout = rng, world_size, call_timeout
        self.kinds, self.every = kinds, every
        self.counts = counts
        self.pending: dict | None = None
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.stopped: dict[int, threading.Timer] = {}
        self.thread = threading.Thread(target=self.clock, name="chaos-faults", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def take(self) -> dict | None:
        with self.lock:
            fault, self.pending = self.pending, None
            return fault

    def put_back(self, fault: dict) -> None:
        """The call was refused before it was sent: its fault goes to the next call
        (unless a newer one waits)."""
        with self.lock:
            if self.pending is None:
                self.pending = {"rank": fault["rank"], "means": fault["means"]}

    def clock(self) -> None:
        kinds, weights = self.kinds, [KINDS[k] for k in self.kinds]
        while not self.stopping.wait(self.rng.uniform(*self.every)):
            kind = self.rng.choices(kinds, weights)[0]
            rank = self.rng.randrange(self.world_size)
            self.counts[kind] += 1
            if kind in ("sigkill", "sigstop"):
                pid = rank_pids().get(rank)
                if pid is None:
                    self.counts[f"{kind} (no rank {rank} then)"] += 1
                    continue
                if kind == "sigkill":
                    signal_rank(pid, signal.SIGKILL)
                    continue
                signal_rank(pid, signal.SIGSTOP)
                timer = threading.Timer(self.call_timeout + self.rng.uniform(0.5, 2.0),
                                        signal_rank, (pid, signal.SIGCONT))
                timer.daemon = True
                with self.lock:
                    self.stopped[pid] = timer
                timer.start()
                continue
            means = {"raise_one": "raise", "raise_all": "raise"}.get(kind, kind)
            with self.lock:
                self.pending = {"rank": "all" if kind == "raise_all" else rank,
                                "means": means}

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=10)

    def resume_stopped(self) -> None:
        """After shutdown: no SIGCONT timer outlives the runner."""
        with self.lock:
            timers = list(self.stopped.values())
        for timer in timers:
            timer.cancel()
            timer.join(timeout=5)


class Watchdog:
    """Every wait of the soak runs under ``bound(what, seconds)``; one past its bound
    calls ``on_stuck(what, seconds)`` (from the watchdog's thread)."""

    def __init__(self, on_stuck: Callable[[str, float], None]) -> None:
        self.on_stuck = on_stuck
        self.waits: dict[int, tuple[str, float, float]] = {}
        self.ids = itertools.count()
        self.lock = threading.Lock()
        threading.Thread(target=self.watch, name="chaos-watchdog", daemon=True).start()

    @contextlib.contextmanager
    def bound(self, what: str, seconds: float) -> Iterator[None]:
        key = next(self.ids)
        with self.lock:
            self.waits[key] = (what, seconds, time.monotonic() + seconds)
        try:
            yield
        finally:
            with self.lock:
                del self.waits[key]

    def watch(self) -> None:
        while True:
            time.sleep(0.5)
            now = time.monotonic()
            with self.lock:
                late = [(what, s) for what, s, deadline in self.waits.values() if now > deadline]
            if late:
                self.on_stuck(*late[0])
                return


def dump_stacks() -> None:
    sys.stdout.flush()
    faulthandler.dump_traceback(file=sys.stdout, all_threads=True)
    sys.stdout.flush()


def watch_restarts(on_record: Callable[[logging.LogRecord], None], verbose: bool) -> None:
    """Hand the runner's restart records (WARNING with ``restart_seconds``, or ERROR
    "could not restart") of the ``reactor_dist`` logger to ``on_record``; print the
    other WARNING and ERROR records if ``verbose``."""

    class Restarts(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if hasattr(record, "restart_seconds") or "could not restart" in message:
                on_record(record)
            elif verbose:
                print(f"  log {record.levelname}: {message.splitlines()[0][:200]}",
                      flush=True)

    logger = logging.getLogger("reactor_dist")
    logger.setLevel(logging.WARNING)
    logger.addHandler(Restarts(logging.WARNING))


def marked() -> set[int]:
    """Processes started by this process's ranks (and the ranks), wherever they went."""
    found = set()
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if p.environ().get(MARK_ENV, "").startswith(f"{os.getpid()}-") and \
                    p.status() != psutil.STATUS_ZOMBIE:
                found.add(p.pid)
    return found


def ipc_dirs() -> set[str]:
    pattern = f"{IPC_DIR_PREFIX}{os.getpid()}-*"
    return {path for base in {tempfile.gettempdir(), "/tmp"}
            for path in glob.glob(os.path.join(base, pattern))}


def shm_entries() -> list[str]:
    prefix = segments.owner_prefix() + "."
    return [n for n in os.listdir(segments.DEFAULT_DIR) if n.startswith(prefix)]


def leftovers() -> list[str]:
    """After a runner's shutdown: what it left (processes, /dev/shm entries, ipc dirs);
    each is then removed, so that the next runner starts clean."""
    deadline = time.monotonic() + 5.0
    while True:
        procs = marked() | {p.pid for p in psutil.Process().children(recursive=True)
                            if _running(p)}
        procs -= Template.pids()  # they serve every runner of the process (template.py)
        if not procs or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    left = [f"process {pid}" for pid in sorted(procs)]
    left += [f"/dev/shm/{name}" for name in shm_entries()]
    left += [f"ipc dir {path}" for path in sorted(ipc_dirs())]
    end_everything()
    return left


def _running(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def end_everything() -> None:
    """SIGKILL whatever of ours still runs; remove our /dev/shm entries and ipc dirs."""
    for pid in (marked() | {p.pid for p in psutil.Process().children(recursive=True)}) \
            - Template.pids():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    for child in psutil.Process().children(recursive=True):
        if child.pid in Template.pids():
            continue
        with contextlib.suppress(psutil.Error):
            child.wait(timeout=5)
    for name in shm_entries():
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(segments.DEFAULT_DIR, name))
    for path in ipc_dirs():
        shutil.rmtree(path, ignore_errors=True)


def table(tallies: dict) -> str:
    """One row per scenario and world size, then each outcome's count per row."""
    cells = sorted(tallies)
    names = [f"{s} ws={w}" for s, w in cells]
    head = ["", *names, "all"]
    width = max(12, *(len(n) for n in names)) + 1
    first = max(34, *(len(k) for t in tallies.values() for k in t.outcomes), 0) + 2

    def line(label: str, values: list) -> str:
        return f"{label:<{first}}" + "".join(f"{v:>{width}}" for v in values)

    def row(label: str, get: Callable[[Any], Any], total: Any = None) -> str:
        values = [get(tallies[c]) for c in cells]
        return line(label, [*values, sum(values) if total is None else total])

    def seconds(t: Any, how: Callable[[list[float]], float]) -> str:
        return f"{how(t.restart_seconds):.2f}" if t.restart_seconds else "-"

    every = [s for t in tallies.values() for s in t.restart_seconds]
    out = [line(head[0], head[1:])]
    out.append(row("runner lifetimes", lambda t: t.lifetimes))
    out.append(row("calls made", lambda t: t.calls))
    keys = sorted({k for t in tallies.values() for k in t.outcomes},
                  key=lambda k: (k not in ("correct", "left early", "wrong", "cancelled"), k))
    for key in keys:
        out.append(row(f"  {key}", lambda t, k=key: t.outcomes[k]))
    out.append(row("stream items checked", lambda t: t.items))
    out.append(row("faults injected", lambda t: sum(v for k, v in t.faults.items()
                                                    if "(" not in k)))
    for kind in KINDS:
        out.append(row(f"  {kind}", lambda t, k=kind: t.faults[k]))
    out.append(row("restarts (automatic + restart())", lambda t: len(t.restart_seconds)))
    out.append(row("  restart s median", lambda t: seconds(t, statistics.median),
                   f"{statistics.median(every):.2f}" if every else "-"))
    out.append(row("  restart s max", lambda t: seconds(t, max),
                   f"{max(every):.2f}" if every else "-"))
    out.append(row("  ranks kept (rejoin())", lambda t: t.kept))
    out.append(row("  ranks replaced", lambda t: t.replaced))
    out.append(row("  ranks taken by a spare", lambda t: t.taken))
    out.append(row("  restarts that failed", lambda t: t.restart_failed))
    out.append(row("  restarts cut short by shutdown()", lambda t: t.restart_cut))
    out.append(row("  restart() by the harness", lambda t: t.explicit))
    out.append(row("leftovers after shutdown", lambda t: len(t.leftovers)))
    return "\n".join(out)
