"""Rank processes: spawning, their output, noticing their death, ending them.

Each rank is a plain subprocess in a process group of its own, so that one
``killpg`` ends the rank together with every process its worker started, and a
terminal's Ctrl-C (sent to the foreground group) does not reach it.  It stays in
the caller's session: with the kernel's scheduler autogroups (one per session) a
session of its own would cost every call about 15 us of cross-group wake-ups.
Its stdout and stderr share one pipe, which a reader thread forwards to
the application's stderr line by line, prefixed ``[rank N]``, keeping the last
lines for crash reports.  A pidfd per rank, watched by a :class:`DeathWatch`
thread, makes a death an event that wakes the runner's wait, not something a
timer discovers.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import os
import select
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil

TAIL_LINES = 200  # enough for a faulthandler dump of every thread
# Inherited by every process a rank starts: finds them when the process tree no longer
# does (their rank died and they left its process group, or a daemon double-forked).
MARK_ENV = "REACTOR_DIST_RANK_MARK"
# Python 3.10 has no process_group=: a new session also makes a new group.
OWN_GROUP: dict[str, Any] = (
    {"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True})


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class RankProcess:
    """One rank's subprocess, its output pump and its death notice."""

    def __init__(self, rank: int, cmd: list[str], env: dict[str, str], cwd: str,
                 bootstrap: bytes) -> None:
        self.rank = rank
        self.mark = f"{os.getpid()}-{id(self):x}-{os.urandom(4).hex()}"
        self.popen = subprocess.Popen(
            cmd, env={**env, MARK_ENV: self.mark}, cwd=cwd, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, close_fds=True, **OWN_GROUP,
        )
        self.pid = self.pgid = self.popen.pid
        self.launcher_pid = self.pid  # differs when a launch_prefix wraps the launcher
        try:
            self.pidfd: int | None = os.pidfd_open(self.pid)
        except (AttributeError, OSError):
            self.pidfd = None
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.lines_seen = 0
        self.last_output = 0.0  # monotonic time of the latest line
        self._partial = b""
        self._out_lock = threading.Lock()
        self._out_fd = self.popen.stdout.fileno()
        self._reader = threading.Thread(target=self._pump, name=f"reactor-dist-rank{rank}-out",
                                        daemon=True)
        self._reader.start()
        try:  # The secret travels here, never in argv or the environment.
            self.popen.stdin.write(bootstrap)
            self.popen.stdin.close()
        except BrokenPipeError:
            pass  # died at once; the death notice tells the story

    # -- output ---------------------------------------------------------------
    def _pump(self) -> None:
        """Forward the rank's output; reads happen under a lock so that drain() can
        take the rest of the pipe itself and know that nothing is half-processed."""
        fd = self._out_fd
        os.set_blocking(fd, False)
        readable = select.poll()
        readable.register(fd, select.POLLIN | select.POLLHUP)
        while True:
            readable.poll()
            with self._out_lock:
                if not self._read_some():
                    break
        with self._out_lock:
            if self._partial:
                self._emit(self._partial)
                self._partial = b""

    def _read_some(self) -> bool:
        """Read what the pipe holds now; False at end of file."""
        try:
            data = os.read(self._out_fd, 65536)
        except BlockingIOError:
            return True  # drain() took it first
        except OSError:
            return False
        if not data:
            return False
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            self._emit(line)
        return True

    def _emit(self, raw: bytes) -> None:
        line = raw.decode("utf-8", "replace").rstrip("\r")
        self.tail.append(line)
        self.lines_seen += 1
        self.last_output = time.monotonic()
        try:
            sys.stderr.write(f"[rank {self.rank}] {line}\n")
            sys.stderr.flush()
        except Exception:
            pass  # a closed stderr must not kill the pump

    def _pending_bytes(self) -> int:
        try:
            return struct.unpack("i", fcntl.ioctl(self._out_fd, termios.FIONREAD, b"\0\0\0\0"))[0]
        except OSError:
            return 0

    def drain(self) -> None:
        """Take in everything the rank wrote before it died (it is in the pipe by now)."""
        with self._out_lock:
            while self._pending_bytes() > 0 and self._read_some():
                pass

    def last_lines(self, n: int = 20) -> list[str]:
        lines = list(self.tail)[-n:]
        if self._partial:
            lines.append(self._partial.decode("utf-8", "replace"))
        return lines

    # -- life and death ---------------------------------------------------------
    def alive(self) -> bool:
        return self.popen.poll() is None

    def exit_description(self) -> str:
        code = self.popen.poll()
        if code is None:
            return "still running"
        if code < 0:
            name = signal_name(-code)
            hint = " (the kernel OOM killer sends this too)" if -code == signal.SIGKILL else ""
            return f"killed by {name}{hint}"
        return f"exited with code {code}"

    def report_lines(self) -> list[str]:
        """The last lines; after a fatal error (faulthandler's dump on SIGSEGV, SIGABRT,
        ...) the lines before it, its cause and the crashing thread's stack, which the
        dump of the other threads would otherwise push out of the last lines."""
        lines = self.last_lines(TAIL_LINES)
        fatal = max((i for i, line in enumerate(lines) if line.startswith("Fatal Python error")),
                    default=None)
        if fatal is None:
            return lines[-20:]
        shown = lines[max(0, fatal - 5):fatal + 1]
        current = next((i for i in range(fatal, len(lines))
                        if lines[i].startswith("Current thread")), None)
        if current is not None:
            end = next((i for i in range(current, len(lines)) if not lines[i].strip()), len(lines))
            shown += lines[current:end]
        return shown

    def crash_report(self) -> str:
        self.drain()
        lines = self.report_lines()
        shown = "\n".join(f"    {line}" for line in lines) if lines else "    (no output)"
        return f"rank {self.rank} (pid {self.pid}) {self.exit_description()}; last output:\n{shown}"

    def signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, sig)

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.pid).children(recursive=True)
        except psutil.Error:
            return []

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
        self._reader.join(timeout=1.0)
        with contextlib.suppress(Exception):
            self.popen.stdout.close()


class DeathWatch:
    """A thread that sleeps on the ranks' pidfds and calls ``on_death(ranks)`` once, at
    the first death.  It spares the caller's wait the pidfds: a plain blocking receive
    costs an empty call about 15 us less than a poll over the socket and the pidfds."""

    def __init__(self, fds: dict[int, int], on_death: Callable[[list[int]], None]) -> None:
        self._fds = dict(fds)  # pidfd -> rank; the fds stay owned by their RankProcess
        self._on_death = on_death
        self.fired = False  # a rank has died (read by the caller's thread)
        self._stop_r, self._stop_w = os.pipe()
        self._thread = threading.Thread(target=self._run, name="reactor-dist-death-watch",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        waiting = select.poll()
        for fd in (*self._fds, self._stop_r):
            waiting.register(fd, select.POLLIN)
        fired = [fd for fd, _ in waiting.poll()]
        if self._stop_r not in fired:
            self.fired = True
            self._on_death(sorted({self._fds[fd] for fd in fired}))

    def stop(self) -> None:
        """End the thread (before the pidfds it watches are closed)."""
        if self._stop_w < 0:
            return
        os.write(self._stop_w, b"x")
        self._thread.join(timeout=5.0)
        os.close(self._stop_r)
        os.close(self._stop_w)
        self._stop_r = self._stop_w = -1


def wait_all_exit(ranks: list[RankProcess], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if not any(r.alive() for r in ranks):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)


def marked_processes(marks: set[str], known: set[int]) -> list[psutil.Process]:
    """Live processes (other than ``known``) whose environment carries one of ``marks``."""
    found = []
    for p in psutil.process_iter():
        if p.pid in known or p.pid == os.getpid():
            continue
        with contextlib.suppress(psutil.Error):  # gone, a zombie, or not ours to read
            if p.environ().get(MARK_ENV) in marks:
                found.append(p)
    return found


def wait_ended(procs: list[psutil.Process], timeout: float) -> None:
    """Until each process is gone or a zombie: dead, holding nothing, waiting only for
    its new parent (init, which may reap lazily) to reap it."""
    def running(p: psutil.Process) -> bool:
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    deadline = time.monotonic() + timeout
    while any(running(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.005)


def end_ranks(ranks: list[RankProcess], term_grace: float = 2.0) -> None:
    """SIGTERM each rank's process group, SIGKILL what is left, reap everything.

    Descendants are listed first, so that a grandchild which left the process
    group (setsid) is still found and killed; so are the processes carrying a
    rank's mark, which the tree no longer leads to once their rank has died.
    """
    strays = [p for r in ranks for p in r.descendants()]
    strays += marked_processes({r.mark for r in ranks}, {p.pid for p in strays})
    for r in ranks:
        if r.alive():
            r.signal_group(signal.SIGTERM)
    wait_all_exit(ranks, term_grace)
    for r in ranks:
        r.signal_group(signal.SIGKILL)  # also reaches children of an already-dead rank
    for p in strays:
        with contextlib.suppress(psutil.Error):
            p.kill()
    for r in ranks:
        with contextlib.suppress(subprocess.TimeoutExpired):
            r.popen.wait(timeout=5.0)
    wait_ended(strays, timeout=2.0)
    for r in ranks:
        r.close()
