"""placement="local": each rank a child process of this one (:class:`RankProcess`),
started by :class:`LocalPlacement` (the interface both placements answer:
:mod:`reactor_dist.placement.base`).

A local rank is a plain subprocess in a POSIX process group of its own, so that one
``killpg`` ends the rank together with every process its worker started, and a
terminal's Ctrl-C (sent to the foreground process group) does not reach it.  It
stays in the caller's session: with the kernel's scheduler autogroups (one per
session) a session of its own would cost every call about 15 us of cross-group
wake-ups.  Its output goes through :class:`reactor_dist.placement.output.RankOutput`;
the death watch sleeps on its pidfd (:class:`~reactor_dist.placement.base.DeathWatch`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import psutil

from ..device import cuda_visible_devices, gpu_index
from ..wire.protocol import MARK_ENV, RANK_SIGNALS, Bootstrap, torchrun_env
from . import stacks, template
from .base import (
    TERM_GRACE,
    DeathWatch,
    Placement,
    Rank,
    Ranks,
    signal_name,
)
from .output import RankOutput
from .rank_env import RANK_ENV_DEFAULTS

if TYPE_CHECKING:
    from ..caller.bus import Bus

# Python 3.10 has no process_group=: a new session also makes a new process group.
OWN_PROCESS_GROUP: dict[str, Any] = (
    {"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True})
# A rank never looks in the working directory for modules: ``-m`` or ``-c`` would put
# it first on sys.path, and whoever may write there would run code in the rank before
# the bootstrap is read.  The rank then takes the caller's own sys.path from the bootstrap.
# Its first statement blocks RANK_SIGNALS, before any import: a thread started by an
# import (numpy's OpenBLAS starts one per core as reactor_dist's package imports it)
# would otherwise have them unblocked, take one (GROUP_ABORT_SIGNAL at a restart), and
# its default action would end the survivor it was meant to release
# (reactor_dist.rank.group).
RANK_MAIN = (f"import signal; signal.pthread_sigmask(signal.SIG_BLOCK, "
             f"{set(RANK_SIGNALS)}); import runpy; "
             f"runpy.run_module('reactor_dist.rank', run_name='__main__', alter_sys=True)")
SAFE_PATH: list[str] = (["-P", "-c", RANK_MAIN] if sys.version_info >= (3, 11) else
                        ["-c", "import sys; del sys.path[0]; " + RANK_MAIN])
RANK_START_ENV = "REACTOR_DIST_RANK_START"  # "fork" (the default) or "spawn"
HOSTNAME = socket.gethostname()  # where the local ranks run
log = logging.getLogger("reactor_dist")


def forking_chosen() -> bool:
    """Not turned off: ``REACTOR_DIST_RANK_START=spawn`` spawns every rank (``fork``, the
    default, forks the local ranks from a template)."""
    choice = os.environ.get(RANK_START_ENV, "fork")
    if choice not in ("fork", "spawn"):
        raise ValueError(f"REACTOR_DIST_RANK_START must be 'fork' or 'spawn', got {choice!r}")
    return choice == "fork"


def free_port() -> int:
    """A free TCP port on loopback (MASTER_PORT for models that form their own group)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankProcess(Rank):
    """A rank that is a child process of this one, and its output: every rank of
    placement="local", and the one rank of a Ray host (reactor_dist.placement.ray_host) on
    its node."""

    hostname = HOSTNAME

    @classmethod
    def spawn(cls, rank: int, world_size: int, bootstrap: bytes, *, master_port: int,
              env: dict[str, str], gpus: list[int] | None, launch_prefix: list[str],
              output: str = "stderr", torch_env: dict[str, str] | None = None,
              label: str = "", fork: bool = False, torch: bool = False) -> RankProcess:
        """Start rank ``rank``: ``python -P -m reactor_dist.rank`` (behind ``launch_prefix``),
        or forked from a template where ``fork`` (reactor_dist.placement.template; one that imported
        torch where ``torch``, the rank forms a torch group), with the torchrun
        environment (``torch_env``, else this machine's) and ``env``; the bootstrap goes to
        its stdin, its lines where ``output`` says (output.OUTPUT_MODES)."""
        full_env = {**RANK_ENV_DEFAULTS, **os.environ}  # the caller's own value wins
        full_env.update(env)
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        full_env["PYTHONPATH"] = os.pathsep.join(
            [package_root] + [p for p in full_env.get("PYTHONPATH", "").split(os.pathsep) if p])
        full_env.update(torch_env or torchrun_env(rank, world_size, master_port),
                        PYTHONUNBUFFERED="1")
        if gpus is not None:  # each GPU once: "0,0" would show CUDA none
            full_env["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices(gpus)
        prefix = [part.replace("{rank}", str(rank)) for part in launch_prefix]
        cmd = prefix + [sys.executable, *SAFE_PATH]
        return cls(rank, cmd, full_env, os.getcwd(), bootstrap, output, label, fork, torch)

    def __init__(self, rank: int, cmd: list[str], env: dict[str, str], cwd: str,
                 bootstrap: bytes, output: str = "stderr", label: str = "",
                 fork: bool = False, torch: bool = False) -> None:
        self.rank = rank
        self.mark = f"{os.getpid()}-{id(self):x}-{os.urandom(4).hex()}"
        self.popen: subprocess.Popen[bytes] | template.Forked = self._start(
            cmd, {**env, MARK_ENV: self.mark}, cwd, fork, torch)
        self.pid = self.pgid = self.popen.pid
        # Ours until the final kill: a dead rank is only looked at (waitid WNOWAIT through
        # its pidfd), never reaped before end_ranks signalled its group, so that its pid,
        # and with it the group id, cannot pass to another process meanwhile.
        self.pidfd = -1
        with contextlib.suppress(AttributeError, OSError):
            self.pidfd = os.pidfd_open(self.pid)
        self.returncode: int | None = None
        self.launcher_pid = self.pid  # differs when a launch_prefix wraps the rank
        self.output = RankOutput(rank, self.popen.stdout.fileno(), output, label)
        try:  # The secret travels here, never in argv or the environment.
            self.popen.stdin.write(bootstrap)
            self.popen.stdin.close()
        except BrokenPipeError:
            pass  # died at once; the death notice tells the story

    @staticmethod
    def _start(cmd: list[str], env: dict[str, str], cwd: str, fork: bool,
               torch: bool) -> subprocess.Popen[bytes] | template.Forked:
        if fork:
            try:
                return template.Forked(env, cwd, torch)
            except template.TemplateFailed as e:
                log.warning("the rank template did not fork a rank (%s): spawning it "
                            "instead", e)
        return subprocess.Popen(
            cmd, env=env, cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, close_fds=True, **OWN_PROCESS_GROUP)

    def poll(self) -> int | None:
        """The exit code (negative: the signal) once the rank died, without reaping it."""
        if self.returncode is None and self.pidfd < 0:
            return self.popen.poll()  # no pidfd: reaps, and signal() then refrains
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
        return (f"{self.output.label} (pid {self.pid}) {self.exit_description()}; last "
                f"output:\n{shown}")

    def become(self, rank: int) -> None:
        self.rank = self.output.rank = rank
        self.output.label = f"rank {rank}"

    def signal(self, sig: int, group: bool = True) -> None:
        if not group:
            if self.popen.returncode is None:  # else its pid may be somebody else's now
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(self.launcher_pid, sig)
            return
        if self.popen.returncode is not None:
            return  # reaped: its pid, which named the group, may be somebody else's now
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, sig)

    def stacks_later(self) -> stacks.Dump:
        """SIGUSR1 now, which faulthandler answers in its output (reactor_dist.placement.stacks)."""
        return stacks.Dump(self)

    def watch_with(self, deaths: DeathWatch) -> None:
        """Its pidfd, and its launcher's where that is another process."""
        deaths.watch(self)
        if self.launcher_pid != self.pid:
            deaths.watch(self, self.launcher_pid)

    def runs_in(self, pid: int, deaths: DeathWatch) -> None:
        """With a launch_prefix the rank's code may run in a grandchild: watch it too."""
        if pid != self.pid:
            self.launcher_pid = pid
            deaths.watch(self, pid)

    @classmethod
    def end_all(cls, ranks: Sequence[Rank], grace: float, term_grace: float) -> None:
        procs = cast("list[RankProcess]", list(ranks))
        if grace > 0:
            stopped = [p for p in procs if stacks.stopped_note(p) is not None]
            for p in stopped:
                log.info("rank %d (pid %d) is stopped: ending it without grace", p.rank, p.pid)
            wait_all_exit([p for p in procs if p not in stopped], grace)
        end_ranks(procs, term_grace)

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


class LocalPlacement(Placement):
    """placement="local": each rank a child process of this one (RankProcess)."""

    def __init__(self, world_size: int, *, env: dict[str, str], gpus: list[int] | None,
                 launch_prefix: list[str], output: str = "stderr", torch: bool = False) -> None:
        self.world_size, self.env, self.gpus = world_size, env, gpus
        self.launch_prefix, self.output = launch_prefix, output
        # The ranks are forked from a template (reactor_dist.placement.template), one that imported
        # torch where they form a torch group, unless a launch_prefix runs them or
        # REACTOR_DIST_RANK_START=spawn says otherwise.
        self.fork, self.torch = not launch_prefix and forking_chosen(), torch
        self.master_port = 0  # MASTER_PORT of the ranks (models that form their own group)

    @property
    def shares_memory(self) -> bool:
        return True

    def bootstrap_fields(self, rank: int) -> dict[str, Any]:
        return {}  # the bootstrap's defaults: ipc://, /dev/shm, GPU index = LOCAL_RANK

    def start(self, ranks: Ranks, bootstrap: Callable[[int], Bootstrap], bus: Bus,
              deadline: float) -> None:
        # For models that form their own group (init_process_group=False): one port for
        # all ranks. With our group, rank 0's store binds port 0 and Kind.INIT carries its port.
        self.master_port = free_port()
        for rank in range(self.world_size):
            ranks.add(self._spawn(rank, bootstrap))

    def restart(self, replaced: list[int], old: Ranks, ranks: Ranks,
                bootstrap: Callable[[int], Bootstrap]) -> None:
        for rank in range(self.world_size):
            ranks.add(self._spawn(rank, bootstrap) if rank in replaced else old.procs[rank])

    def device_index(self, place: int) -> int:
        return gpu_index(self.gpus, place)

    def gpu_of(self, place: int) -> int:
        return place if self.gpus is None else self.gpus[place]

    def start_spare(self, slot: int, place: int, bootstrap: Bootstrap, label: str) -> Rank:
        # The torchrun environment of its GPU (LOCAL_RANK: the GPU's index among the
        # visible ones), with no RANK until it takes one (the rank's process sets it
        # then); ``{rank}`` of a launch_prefix: that index too.
        index = self.device_index(place)
        env = torchrun_env(index, self.world_size, self.master_port)
        env.pop("RANK")
        return RankProcess.spawn(index, self.world_size, bootstrap.to_bytes(),
                                 master_port=self.master_port, env=self.env, gpus=self.gpus,
                                 launch_prefix=self.launch_prefix, output=self.output,
                                 torch_env=env, label=label, fork=self.fork,
                                 torch=self.torch)

    def _spawn(self, rank: int, bootstrap: Callable[[int], Bootstrap]) -> RankProcess:
        return RankProcess.spawn(rank, self.world_size, bootstrap(rank).to_bytes(),
                                 master_port=self.master_port, env=self.env, gpus=self.gpus,
                                 launch_prefix=self.launch_prefix, output=self.output,
                                 fork=self.fork, torch=self.torch)

    def close(self, ranks: Ranks, grace: float) -> None:
        ranks.end(grace)


def wait_all_exit(ranks: Sequence[RankProcess], timeout: float) -> bool:
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


def end_ranks(ranks: Sequence[RankProcess], term_grace: float = TERM_GRACE) -> None:
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
            r.signal(signal.SIGTERM)
            # A stopped process acts on SIGTERM only once continued: no grace to wait out.
            r.signal(signal.SIGCONT)
    wait_all_exit(ranks, term_grace)
    for r in ranks:
        r.signal(signal.SIGKILL)  # also reaches children of an already-dead rank
    for p in strays:
        with contextlib.suppress(psutil.Error):
            p.kill()
    for r in ranks:
        with contextlib.suppress(subprocess.TimeoutExpired):
            r.popen.wait(timeout=5.0)
    wait_ended(strays, timeout=2.0)
    for r in ranks:
        r.close()
