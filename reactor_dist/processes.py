"""The rank processes: starting them, noticing a death, ending them.

Each rank is a plain subprocess in a POSIX process group of its own, so that one
``killpg`` ends the rank together with every process its worker started, and a
terminal's Ctrl-C (sent to the foreground process group) does not reach it.  It
stays in the caller's session: with the kernel's scheduler autogroups (one per
session) a session of its own would cost every call about 15 us of cross-group
wake-ups.  Its output goes through :class:`reactor_dist.output.RankOutput`.

A death is noticed one way only: :class:`DeathWatch`, a thread that sleeps on the
ranks' pidfds (and on a launcher's pidfd where a ``launch_prefix`` wraps it) and
posts one notice at the first death, which wakes the runner's wait like a reply
would.  Where a pidfd cannot be had it checks those ranks every 20 ms instead.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import psutil

from . import stacks
from .errors import RankFailure, RankInfo
from .output import RankOutput
from .protocol import MARK_ENV, torchrun_env

# Python 3.10 has no process_group=: a new session also makes a new process group.
OWN_PROCESS_GROUP: dict[str, Any] = (
    {"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True})
# A rank never looks in the working directory for modules: ``-m`` would put it first on
# sys.path, and whoever may write there would run code in the rank before the bootstrap
# is read.  The rank then takes the caller's own sys.path from the bootstrap.
SAFE_PATH: list[str] = (["-P", "-m", "reactor_dist.rank"] if sys.version_info >= (3, 11) else
                        ["-c", "import sys; del sys.path[0]; import runpy; "
                               "runpy.run_module('reactor_dist.rank', run_name='__main__')"])
POLL_MS = 20  # how often the watch checks ranks it has no pidfd for
HOSTNAME = socket.gethostname()  # where the local ranks run
log = logging.getLogger("reactor_dist")


def free_port() -> int:
    """A free TCP port on loopback (MASTER_PORT for models that form their own group)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class RankProcess:
    """One rank's subprocess and its output."""

    hosted = False  # a child of this process (placement.HostedRank: a Ray actor's)
    hostname = HOSTNAME

    def __init__(self, rank: int, cmd: list[str], env: dict[str, str], cwd: str,
                 bootstrap: bytes, output: str = "stderr") -> None:
        self.rank = rank
        self.mark = f"{os.getpid()}-{id(self):x}-{os.urandom(4).hex()}"
        self.popen = subprocess.Popen(
            cmd, env={**env, MARK_ENV: self.mark}, cwd=cwd, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, close_fds=True,
            **OWN_PROCESS_GROUP,
        )
        self.pid = self.pgid = self.popen.pid
        # Ours until the final kill: a dead rank is only looked at (waitid WNOWAIT through
        # its pidfd), never reaped before end_ranks signalled its group, so that its pid,
        # and with it the group id, cannot pass to another process meanwhile.
        self.pidfd = -1
        with contextlib.suppress(AttributeError, OSError):
            self.pidfd = os.pidfd_open(self.pid)
        self.returncode: int | None = None
        self.launcher_pid = self.pid  # differs when a launch_prefix wraps the rank
        self.output = RankOutput(rank, self.popen.stdout.fileno(), output)
        try:  # The secret travels here, never in argv or the environment.
            self.popen.stdin.write(bootstrap)
            self.popen.stdin.close()
        except BrokenPipeError:
            pass  # died at once; the death notice tells the story

    def poll(self) -> int | None:
        """The exit code (negative: the signal) once the rank died, without reaping it."""
        if self.returncode is None and self.pidfd < 0:
            return self.popen.poll()  # no pidfd: reaps, and signal_group then refrains
        if self.returncode is None:
            with contextlib.suppress(ChildProcessError):
                info = os.waitid(os.P_PIDFD, self.pidfd,
                                 os.WEXITED | os.WNOHANG | os.WNOWAIT)
                if info is not None and info.si_pid:
                    self.returncode = info.si_status if info.si_code == os.CLD_EXITED \
                        else -info.si_status
        return self.returncode

    def alive(self) -> bool:
        return self.poll() is None

    def exit_description(self) -> str:
        code = self.poll()
        if code is None:
            return "still running"
        if code < 0:
            name = signal_name(-code)
            hint = " (the kernel OOM killer sends this too)" if -code == signal.SIGKILL else ""
            return f"killed by {name}{hint}"
        return f"exited with code {code}"

    def stopped(self) -> bool:
        """Stopped (state T, or t under a tracer): it cannot answer until resumed."""
        return self.alive() and stacks.stopped_note(self) is not None

    def report_lines(self) -> list[str]:
        """The lines a crash report shows (a dead rank's pipe drained first)."""
        if not self.alive():
            self.output.drain()
        return self.output.report_lines()

    def crash_report(self) -> str:
        self.output.drain()
        lines = self.output.report_lines()
        shown = "\n".join(f"    {line}" for line in lines) if lines else "    (no output)"
        return f"rank {self.rank} (pid {self.pid}) {self.exit_description()}; last output:\n{shown}"

    def send_signal(self, sig: int) -> None:
        """``sig`` to the rank's own process (where its code runs), not to its group."""
        if self.popen.returncode is None:  # else its pid may be somebody else's now
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self.launcher_pid, sig)

    def signal_group(self, sig: int) -> None:
        if self.popen.returncode is not None:
            return  # reaped: its pid, which named the group, may be somebody else's now
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, sig)

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.pid).children(recursive=True)
        except psutil.Error:
            return []

    def close(self) -> None:
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1
        self.output.join(timeout=1.0)
        with contextlib.suppress(Exception):
            self.popen.stdout.close()


class DeathWatch:
    """The one death detector: a thread that calls ``on_death(ranks)`` once, at the
    first death, and :meth:`dead`, which names the dead ranks without a system call
    while none has died.  It owns the pidfds it watches."""

    def __init__(self, on_death: Callable[[list[int]], None]) -> None:
        self._on_death = on_death
        self._noticed = threading.Lock()  # held for good by the one notice
        self._hosted: list[Any] = []  # placement.HostedRank: their watch calls notice()
        self._fds: dict[int, int] = {}  # pidfd -> rank
        self._unwatched: list[RankProcess] = []  # no pidfd: checked every POLL_MS
        self.fired = False  # a rank has died (read by the caller's thread)
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._run, name="reactor-dist-death-watch",
                                        daemon=True)
        self._started = False

    def watch(self, proc: RankProcess, pid: int | None = None) -> None:
        """Watch ``proc``'s rank through ``pid`` (default: the rank's own process)."""
        try:
            self._fds[os.pidfd_open(pid or proc.pid)] = proc.rank
        except (AttributeError, OSError):
            if pid is None:
                self._unwatched.append(proc)
        if self._started:
            os.write(self._wake_w, b"+")  # look at the new set
        else:
            self._started = True
            self._thread.start()

    def _run(self) -> None:
        while True:
            fds = dict(self._fds)  # watch() may add to it meanwhile
            waiting = select.poll()
            for fd in (*fds, self._wake_r):
                waiting.register(fd, select.POLLIN)
            fired = [fd for fd, _ in waiting.poll(POLL_MS if self._unwatched else -1)]
            if self._wake_r in fired:
                if b"x" in os.read(self._wake_r, 4096):
                    return
                continue
            dead = {fds[fd] for fd in fired} | \
                {p.rank for p in self._unwatched if not p.alive()}
            if dead:
                self.notice(sorted(dead))
                return

    def hosted(self, proc: Any) -> None:
        """Count ``proc`` (a placement.HostedRank) among the ranks :meth:`dead` names;
        its own watch calls :meth:`notice`."""
        self._hosted.append(proc)

    def notice(self, dead: list[int]) -> None:
        """The first death alone reaches ``on_death``."""
        if self._noticed.acquire(blocking=False):
            self.fired = True
            self._on_death(dead)

    def dead(self) -> list[int]:
        if not self.fired:
            return []
        fired = select.poll()
        for fd in self._fds:
            fired.register(fd, select.POLLIN)
        dead = {self._fds[fd] for fd, _ in fired.poll(0)}
        gone = [*self._unwatched, *self._hosted]
        return sorted(dead | {p.rank for p in gone if not p.alive()})

    def close(self) -> None:
        """End the thread and close the pidfds; deaths are expected from here on."""
        if self._wake_w < 0:
            return
        os.write(self._wake_w, b"x")
        if self._started:
            self._thread.join(timeout=5.0)
        for fd in (*self._fds, self._wake_r, self._wake_w):
            os.close(fd)
        self._fds = {}
        self._wake_r = self._wake_w = -1


class Ranks:
    """The rank processes of one runner."""

    def __init__(self, world_size: int, on_death: Callable[[list[int]], None],
                 output: str = "stderr") -> None:
        self.world_size = world_size
        self.output = output  # where the ranks' lines go (output.OUTPUT_MODES)
        self.procs: list[RankProcess] = []
        self.watch = DeathWatch(on_death)

    def spawn(self, rank: int, bootstrap: bytes, *, master_port: int, env: dict[str, str],
              gpus: list[int] | None, launch_prefix: list[str],
              torch_env: dict[str, str] | None = None) -> None:
        """Start rank ``rank``: ``python -P -m reactor_dist.rank`` (behind ``launch_prefix``)
        with the torchrun environment (``torch_env``, else this machine's) and ``env``;
        the bootstrap goes to its stdin."""
        full_env = dict(os.environ)
        full_env.update(env)
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        full_env["PYTHONPATH"] = os.pathsep.join(
            [package_root] + [p for p in full_env.get("PYTHONPATH", "").split(os.pathsep) if p])
        full_env.update(torch_env or torchrun_env(rank, self.world_size, master_port),
                        PYTHONUNBUFFERED="1")
        if gpus is not None:
            full_env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
        prefix = [part.replace("{rank}", str(rank)) for part in launch_prefix]
        cmd = prefix + [sys.executable, *SAFE_PATH]
        proc = RankProcess(rank, cmd, full_env, os.getcwd(), bootstrap, self.output)
        self.procs.append(proc)
        self.watch.watch(proc)

    def keep(self, proc: Any) -> None:
        """restart(): a rank of the generation before, which keeps its process."""
        self.procs.append(proc)
        if proc.hosted:
            self.watch.hosted(proc)
            return
        self.watch.watch(proc)
        if proc.launcher_pid != proc.pid:
            self.watch.watch(proc, proc.launcher_pid)

    def adopt(self, proc: Any) -> None:
        """A rank that another process started (placement.HostedRank), in rank order."""
        self.procs.append(proc)
        self.watch.hosted(proc)

    def found_launcher(self, rank: int, pid: Any) -> None:
        """With a launch_prefix the rank's code may run in a grandchild: watch it too."""
        proc = self.procs[rank]
        if isinstance(pid, int) and pid != proc.pid and not proc.hosted:
            proc.launcher_pid = pid
            self.watch.watch(proc, pid)

    def dead(self) -> list[int]:
        return self.watch.dead()

    def crash_report(self, dead: list[int]) -> str:
        return "\n".join(self.procs[r].crash_report() for r in dead)

    def infos(self, devices: Sequence[str]) -> tuple[RankInfo, ...]:
        """Each rank's record now (``devices``: the supervisor's, once the ranks said)."""
        return tuple(RankInfo(p.rank, p.launcher_pid or None, p.hostname,
                              _device(devices, p.rank), p.alive()) for p in list(self.procs))

    def failures(self, ranks: Sequence[int], devices: Sequence[str], *,
                 seq: int | None = None, method: str | None = None,
                 errors: Mapping[int, BaseException] | None = None,
                 answered: bool = False) -> tuple[RankFailure, ...]:
        """The records of ``ranks`` in a failure of call ``seq`` (None: outside a call),
        each with its exception from ``errors``; ``answered``: they just replied, so
        they run (not stopped: no look at the process state on that path)."""
        records = []
        for rank in ranks:
            proc = self.procs[rank]
            alive = proc.alive()
            code = None if alive else proc.poll()  # None too: a Ray host's that is gone
            died_of = -code if code is not None and code < 0 else None
            records.append(RankFailure(
                rank, proc.launcher_pid or None, proc.hostname, _device(devices, rank),
                alive, exitcode=code if died_of is None else None,
                signal=None if died_of is None else _signal(died_of),
                stopped=alive and not answered and proc.stopped(),
                output=tuple(proc.report_lines()), error=(errors or {}).get(rank),
                call_seq=seq, method=method))
        return tuple(records)

    def stacks(self, silent: list[int]) -> str:
        """Every thread's stack of each silent rank, or why it has none (reactor_dist.stacks),
        shown in the caller's error alone (not also forwarded)."""
        # ``silent`` indexes self.procs (a RankHost's one process is its index 0).
        hosted = {i: self.procs[i].stacks_later() for i in silent
                  if self.procs[i].hosted}  # their hosts dump them meanwhile
        local = iter(stacks.dumps([self.procs[i] for i in silent if i not in hosted]))
        return "\n".join(self.procs[i].stacks_now(hosted[i]) if i in hosted else next(local)
                         for i in silent)

    def end(self, grace: float) -> None:
        """Wait up to ``grace`` for a graceful exit, then end every rank for sure.  A
        stopped rank cannot leave: it gets no grace (end_ranks continues it to end it)."""
        self.watch.close()
        procs = [p for p in self.procs if not p.hosted]  # hosted: placement.RayGroup.close
        if grace > 0:
            stopped = [p for p in procs if stacks.stopped_note(p) is not None]
            for p in stopped:
                log.info("rank %d (pid %d) is stopped: ending it without grace", p.rank, p.pid)
            wait_all_exit([p for p in procs if p not in stopped], grace)
        end_ranks(procs)
        self.procs = []


def _device(devices: Sequence[str], rank: int) -> str | None:
    return devices[rank] if rank < len(devices) else None


def _signal(signum: int) -> int:
    """A signal.Signals (its name and number) where Python knows the number."""
    try:
        return signal.Signals(signum)
    except ValueError:
        return signum


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
    """SIGTERM (and SIGCONT) each rank's process group, SIGKILL what is left, reap
    everything.

    Descendants are listed first, so that a grandchild which left the process
    group (setsid) is still found and killed; so are the processes carrying a
    rank's mark, which the tree no longer leads to once their rank has died.
    """
    if not ranks:
        return
    strays = [p for r in ranks for p in r.descendants()]
    strays += marked_processes({r.mark for r in ranks}, {p.pid for p in strays})
    for r in ranks:
        if r.alive():
            r.signal_group(signal.SIGTERM)
            # A stopped process acts on SIGTERM only once continued: no grace to wait out.
            r.signal_group(signal.SIGCONT)
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
