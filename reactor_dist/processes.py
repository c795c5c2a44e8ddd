"""The ranks of a runner, wherever they run: one handle per rank (:class:`Rank`), the
handles of one generation of ranks (:class:`Ranks`), and where they run
(:class:`Placement`).

A placement starts the ranks and hands back one :class:`Rank` per rank; the supervisor
asks every handle the same things (is it alive, how did it end, its output, its stacks,
its death) and never asks which placement it has.  There are two:
:class:`LocalPlacement`, here, where each rank is a child process of the runner
(:class:`RankProcess`), and ``placement.RayGroup``, where each rank is a child of a Ray
actor on its node (``placement.HostedRank``, which a RankProcess there answers for).

A local rank is a plain subprocess in a POSIX process group of its own, so that one
``killpg`` ends the rank together with every process its worker started, and a
terminal's Ctrl-C (sent to the foreground process group) does not reach it.  It
stays in the caller's session: with the kernel's scheduler autogroups (one per
session) a session of its own would cost every call about 15 us of cross-group
wake-ups.  Its output goes through :class:`reactor_dist.output.RankOutput`.

A death is noticed one way only: :class:`DeathWatch`, a thread that sleeps on the
local ranks' pidfds (and on a launcher's pidfd where a ``launch_prefix`` wraps it) and
posts one notice at the first death, which wakes the runner's wait like a reply
would.  Where a pidfd cannot be had it checks those ranks every 20 ms instead.  A rank
that another thread watches (a Ray host's) posts its notice through the same watch.
"""

from __future__ import annotations

import abc
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
from typing import TYPE_CHECKING, Any, Protocol, cast

import psutil

from . import stacks, template
from .device import cuda_visible_devices, gpu_index
from .errors import RankFailure, RankInfo
from .output import RankOutput
from .protocol import GROUP_ABORT_SIGNAL, MARK_ENV, Bootstrap, torchrun_env
from .rank_env import RANK_ENV_DEFAULTS

if TYPE_CHECKING:
    from .bus import Bus

# Python 3.10 has no process_group=: a new session also makes a new process group.
OWN_PROCESS_GROUP: dict[str, Any] = (
    {"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True})
# A rank never looks in the working directory for modules: ``-m`` or ``-c`` would put
# it first on sys.path, and whoever may write there would run code in the rank before
# the bootstrap is read.  The rank then takes the caller's own sys.path from the bootstrap.
# Its first statement blocks GROUP_ABORT_SIGNAL, before any import: a thread started
# by an import (numpy's OpenBLAS starts one per core as reactor_dist's package imports
# it) would otherwise have it unblocked, take it at a restart, and its default action
# would end the survivor it was meant to release (reactor_dist.group).
RANK_MAIN = (f"import signal; signal.pthread_sigmask(signal.SIG_BLOCK, "
             f"{{{int(GROUP_ABORT_SIGNAL)}}}); import runpy; "
             f"runpy.run_module('reactor_dist.rank', run_name='__main__', alter_sys=True)")
SAFE_PATH: list[str] = (["-P", "-c", RANK_MAIN] if sys.version_info >= (3, 11) else
                        ["-c", "import sys; del sys.path[0]; " + RANK_MAIN])
RANK_START_ENV = "REACTOR_DIST_RANK_START"  # "fork" (the default) or "spawn"
POLL_MS = 20  # how often the watch checks ranks it has no pidfd for
HOSTNAME = socket.gethostname()  # where the local ranks run
TERM_GRACE = 2.0  # seconds from SIGTERM to SIGKILL when the ranks end
REPLACED_TERM_GRACE = 0.2  # the same for the ranks that a restart replaces
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


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class Stacks(Protocol):
    """A rank's stacks on their way (:meth:`Rank.stacks_later`)."""

    def text(self) -> str:
        """Every thread's stack, or why there are none; waits for them if need be."""
        ...


class Rank(abc.ABC):
    """One rank's handle, wherever its process runs: what the supervisor, the death
    watch and the failure records ask of a rank, answered alike for every placement, so
    that none of them asks where the rank runs.  Its placement starts it (a handle comes
    started) and ends it (:meth:`end_all`)."""

    rank: int
    pid: int  # the rank's process, as its placement started it (on its node)
    launcher_pid: int  # where its code runs: pid, or a descendant under a launch_prefix
    hostname: str  # the machine it runs on

    @abc.abstractmethod
    def poll(self) -> int | None:
        """The exit code (negative: the signal) once the rank died; None while it runs,
        and where it cannot be known (its host is gone)."""

    @abc.abstractmethod
    def alive(self) -> bool:
        """Not known to have died."""

    @abc.abstractmethod
    def stopped(self) -> bool:
        """Alive but stopped (state T, or t under a tracer): it cannot answer until resumed."""

    @abc.abstractmethod
    def signal(self, sig: int, group: bool = True) -> None:
        """``sig`` to the rank's process group (the rank and what it started), or with
        ``group`` false to the process its code runs in alone (``launcher_pid``: a
        restart's GROUP_ABORT_SIGNAL); a rank already gone is left alone (its pid may be
        another process's by now)."""

    @abc.abstractmethod
    def report_lines(self) -> list[str]:
        """The lines of its output a crash report shows (a dead rank's last ones)."""

    @abc.abstractmethod
    def crash_report(self) -> str:
        """How it ended and its last lines, for a WorkerCrashed."""

    @abc.abstractmethod
    def stacks_later(self) -> Stacks:
        """Ask for every thread's stack now; the answer's ``text()`` waits for them.
        Every silent rank is asked before any answer is waited for (Ranks.stacks), so
        that they dump side by side."""

    @abc.abstractmethod
    def watch_with(self, deaths: DeathWatch) -> None:
        """Have ``deaths`` (its generation's watch) notice this rank's death."""

    @abc.abstractmethod
    def runs_in(self, pid: int, deaths: DeathWatch) -> None:
        """Its code runs in process ``pid`` (its PONG says so): another process than the
        one started where a ``launch_prefix`` does not exec the rank."""

    def become(self, rank: int) -> None:
        """A spare's handle is now rank ``rank``'s (reactor_dist.spares): its records and
        output say so."""
        self.rank = rank

    @classmethod
    @abc.abstractmethod
    def end_all(cls, ranks: Sequence[Rank], grace: float, term_grace: float) -> None:
        """End ``ranks`` (handles of this class) for sure, side by side: up to ``grace``
        seconds to leave by themselves (after a SHUTDOWN; a stopped rank gets none),
        then SIGTERM, and SIGKILL after ``term_grace`` seconds."""


def end_together(ranks: Sequence[Rank], grace: float, term_grace: float) -> None:
    """End ``ranks`` side by side, each kind of handle as its class does (Rank.end_all)."""
    kinds: dict[type[Rank], list[Rank]] = {}
    for proc in ranks:
        kinds.setdefault(type(proc), []).append(proc)
    for kind, procs in kinds.items():
        kind.end_all(procs, grace, term_grace)


class RankProcess(Rank):
    """A rank that is a child process of this one, and its output: every rank of
    placement="local", and the one rank of a Ray host (reactor_dist.host) on its node."""

    hostname = HOSTNAME

    @classmethod
    def spawn(cls, rank: int, world_size: int, bootstrap: bytes, *, master_port: int,
              env: dict[str, str], gpus: list[int] | None, launch_prefix: list[str],
              output: str = "stderr", torch_env: dict[str, str] | None = None,
              label: str = "", fork: bool = False, torch: bool = False) -> RankProcess:
        """Start rank ``rank``: ``python -P -m reactor_dist.rank`` (behind ``launch_prefix``),
        or forked from a template where ``fork`` (reactor_dist.template; one that imported
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
        """SIGUSR1 now, which faulthandler answers in its output (reactor_dist.stacks)."""
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


class DeathWatch:
    """The one death detector: a thread that calls ``on_death(ranks)`` once, at the
    first death, and :meth:`dead`, which names the dead ranks without a system call
    while none has died.  It owns the pidfds it watches.  Once closed it posts nothing:
    the deaths from then on are expected."""

    def __init__(self, on_death: Callable[[list[int]], None]) -> None:
        self._on_death = on_death
        self._noticed = threading.Lock()  # held for good by the one notice
        self._elsewhere: list[Rank] = []  # watched by another thread, which calls notice()
        self._fds: dict[int, int] = {}  # pidfd -> rank
        self._unwatched: list[RankProcess] = []  # no pidfd: checked every POLL_MS
        self.fired = False  # a rank has died (read by the caller's thread)
        self.closed = False  # close() began: no notice any more
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

    def watched_elsewhere(self, proc: Rank) -> None:
        """Count ``proc`` among the ranks :meth:`dead` names; the thread that watches it
        (placement.RayGroup.watch) calls :meth:`notice`."""
        self._elsewhere.append(proc)

    def notice(self, dead: list[int]) -> None:
        """The first death alone reaches ``on_death``, and none once closed."""
        if not self.closed and self._noticed.acquire(blocking=False):
            self.fired = True
            self._on_death(dead)

    def dead(self) -> list[int]:
        if not self.fired:
            return []
        fired = select.poll()
        for fd in self._fds:
            fired.register(fd, select.POLLIN)
        dead = {self._fds[fd] for fd, _ in fired.poll(0)}
        gone = [*self._unwatched, *self._elsewhere]
        return sorted(dead | {p.rank for p in gone if not p.alive()})

    def close(self) -> None:
        """End the thread and close the pidfds; deaths are expected from here on."""
        self.closed = True
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
    """The rank handles of one generation of a runner's ranks (a restart starts the
    next), in rank order, and the death watch over them."""

    def __init__(self, on_death: Callable[[list[int]], None]) -> None:
        self.procs: list[Rank] = []
        self.watch = DeathWatch(on_death)

    def add(self, proc: Rank) -> None:
        """The next rank's handle, a new one or one kept from the generation before,
        watched from now on."""
        self.procs.append(proc)
        proc.watch_with(self.watch)

    def found_launcher(self, rank: int, pid: Any) -> None:
        """Rank ``rank``'s PONG named the process its code runs in (``pid``)."""
        if isinstance(pid, int):
            self.procs[rank].runs_in(pid, self.watch)

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
        """Every thread's stack of each silent rank, or why it has none, shown in the
        caller's error alone (not also forwarded); ``silent`` indexes the handles (a Ray
        host's one rank is its index 0)."""
        asked = [self.procs[i].stacks_later() for i in silent]  # they dump meanwhile
        return "\n".join(later.text() for later in asked)

    def end(self, grace: float, term_grace: float = TERM_GRACE) -> None:
        """Wait up to ``grace`` for a graceful exit, then end every rank for sure
        (Rank.end_all); the watch first, so that these deaths are no notices."""
        self.watch.close()
        end_together(self.procs, grace, term_grace)
        self.procs = []

    def end_replaced(self, ranks: list[int]) -> None:
        """restart(): ``ranks`` end now (their handles stay, for their placement to
        start them again); none are left after a failed restart ended them all."""
        end_together([self.procs[r] for r in ranks if r < len(self.procs)], 0.0,
                     REPLACED_TERM_GRACE)


class Placement(abc.ABC):
    """Where a runner's ranks run, and how they start and end there.  The supervisor
    holds one and asks it; what differs between placements (how a rank starts, its
    bootstrap's fields, what else ends with the ranks) is all here."""

    @property
    @abc.abstractmethod
    def shares_memory(self) -> bool:
        """Every rank maps this machine's /dev/shm (else payloads travel in-band)."""

    @abc.abstractmethod
    def bootstrap_fields(self, rank: int) -> dict[str, Any]:
        """The fields of rank ``rank``'s bootstrap (protocol.Bootstrap) that this
        placement decides: where the rank reaches the bus and the group's store, its GPU."""

    @abc.abstractmethod
    def start(self, ranks: Ranks, bootstrap: Callable[[int], Bootstrap], bus: Bus,
              deadline: float) -> None:
        """Start every rank (``bootstrap(rank)`` is its bootstrap, with
        :meth:`bootstrap_fields`) by ``deadline`` (time.monotonic()): their handles go
        into ``ranks``, in rank order.  ``bus``: the runner's, for ranks that reach it
        from another machine."""

    @abc.abstractmethod
    def restart(self, replaced: list[int], old: Ranks, ranks: Ranks,
                bootstrap: Callable[[int], Bootstrap]) -> None:
        """restart(): the ``replaced`` ranks (ended: Ranks.end_replaced) start again,
        in the same places; the others keep their handles from ``old``.  ``ranks`` takes
        every rank's handle, in rank order."""

    def spare_fields(self, place: int) -> dict[str, Any]:
        """The fields of the bootstrap of a spare in ``place`` (its GPU's index among
        the visible ones; with Ray, its bundle's) that this placement decides."""
        return {}

    def device_index(self, place: int) -> int:
        """The index among the visible GPUs of the GPU that ``place`` holds (a rank's or
        a spare's bootstrap ``device_index``): ``place`` itself, unless ``gpus=`` names
        a GPU twice (LocalPlacement)."""
        return place

    def gpu_of(self, place: int) -> int:
        """Which GPU ``place`` holds, to tell places that share one (a spare on a rank's
        GPU, reactor_dist.spares.match): each its own unless ``gpus=`` says otherwise."""
        return place

    def store_address(self) -> str:
        """Where the group's store is across nodes (rank 0's node, as it is now); ""
        where it is a file in the private directory."""
        return ""

    @abc.abstractmethod
    def start_spare(self, slot: int, place: int, bootstrap: Bootstrap, label: str) -> Rank:
        """Start a spare (reactor_dist.spares) in ``place`` (see :meth:`spare_fields`),
        its output's lines prefixed with ``label``; its handle."""

    def end_ranks(self, ranks: Ranks) -> None:
        """A restart failed: every rank ends now; what the placement holds stays until
        :meth:`close`."""
        ranks.end(0.0)

    @abc.abstractmethod
    def close(self, ranks: Ranks, grace: float) -> None:
        """Every rank ends (``grace`` seconds to leave by itself first), and whatever the
        placement holds with it; safe in any state, and twice."""


class LocalPlacement(Placement):
    """placement="local": each rank a child process of this one (RankProcess)."""

    def __init__(self, world_size: int, *, env: dict[str, str], gpus: list[int] | None,
                 launch_prefix: list[str], output: str = "stderr", torch: bool = False) -> None:
        self.world_size, self.env, self.gpus = world_size, env, gpus
        self.launch_prefix, self.output = launch_prefix, output
        # The ranks are forked from a template (reactor_dist.template), one that imported
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


def _device(devices: Sequence[str], rank: int) -> str | None:
    return devices[rank] if rank < len(devices) else None


def _signal(signum: int) -> int:
    """A signal.Signals (its name and number) where Python knows the number."""
    try:
        return signal.Signals(signum)
    except ValueError:
        return signum


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
