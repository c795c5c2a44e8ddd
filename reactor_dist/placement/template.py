"""Ranks forked from a template process that has imported torch already.

A rank that forms a torch group imports ``torch.distributed`` first: 2-3 s of CPU, paid
again by every rank at every start, restart and spare.  A template is a process that
imports it once and then forks each such rank on request (a *zygote*, as Android and
Chromium call it; multiprocessing's forkserver is the same idea): the rank starts with
torch in memory, in milliseconds.  Nothing else is imported before the fork: a forked
rank imports reactor_dist and its worker itself, under its own environment, as a
spawned one does.

The template never touches CUDA (``import torch`` does not), is single-threaded when it
forks, and is started with the environment its ranks would have but for the variables
that differ per rank and that torch reads only later (:data:`PER_RANK`), so that what
torch reads as it is imported (``OMP_NUM_THREADS``, ``TORCH_*``) is what a spawned rank
reads; another environment gets another template.  Each rank gets its own environment,
working directory, process group, stdin and output, and reseeded random generators.

A forked rank is a child of the runner, as a spawned one is: the template forks an
intermediate process, which forks the rank and exits, and the runner, a child
subreaper (``PR_SET_CHILD_SUBREAPER``) only while it waits for that reply, adopts the
orphan.  The runner waits for it, signals it and reads its exit status like any child.
Any other orphan of the application's own processes handed to it in that window is
waited for (:func:`reap_adopted`), never left a zombie; an application that is a
subreaper itself stays one, and what it adopts stays its own.

One template serves every runner of a process.  It stays while a runner of the process
is started, and for :data:`IDLE` seconds (:func:`set_rank_template_idle`) after the
last one shut down, so that the next runner's ranks start in milliseconds too; then it
exits (also when the process's end of its socket closes, or the process dies; at once
with :func:`close_rank_templates`).  ``/proc`` names it
:data:`~reactor_dist.wire.protocol.TEMPLATE_NAME`.  Where a template cannot be had,
ranks are spawned (``local.RankProcess``), with a warning that says why.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import logging
import os
import resource
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from typing import Any, cast

from ..wire.protocol import (
    MARK_ENV,
    RANK_SIGNALS,
    TEMPLATE_FD_ENV,
    TEMPLATE_NAME,
    ForkReply,
    ForkRequest,
)

log = logging.getLogger("reactor_dist")

# What the template process runs: the rank's own program (local.RANK_MAIN) with
# serve() before it, which returns only in a forked rank.
# serve() before it, which returns only in a forked rank; its arguments are the modules it
# imports before it forks (PRELOAD, TORCH).
TEMPLATE_MAIN = (f"import signal; signal.pthread_sigmask(signal.SIG_BLOCK, "
                 f"{set(RANK_SIGNALS)}); "
                 f"from reactor_dist.placement.template import serve; "
                 f"serve(); import runpy; "
                 f"runpy.run_module('reactor_dist.rank', run_name='__main__', alter_sys=True)")
# What every rank imports from outside the standard library (with what they import),
# ~0.3 s of CPU; and what a rank that forms a torch group imports besides, 2-3 s.
PRELOAD = ("numpy", "zmq", "msgpack", "psutil")
TORCH = ("torch.distributed",)
# The variables that the interpreter, its C library or the preloaded modules (their
# native libraries: OpenMP, OpenBLAS, MKL, CUDA's) may read before the fork: a template
# serves the ranks whose values of these are its own.  Any other variable (the caller's
# own, PYTEST_CURRENT_TEST, ...) is only set in the forked rank, whose worker and its
# imports read it there, as a spawned rank would.
READ_AT_IMPORT = ("PYTHON", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "GOTO_", "BLIS_",
                  "NUMPY_", "TORCH", "PYTORCH_", "THP_", "CUDA_", "NVIDIA_", "NCCL_", "GLOO_",
                  "ZMQ", "LD_", "MALLOC_", "GLIBC_", "LC_", "LANG", "TZ", "TMPDIR", "HOME",
                  "PATH")
# Set per rank, and read by torch only once the rank forms its group or picks its GPU.
PER_RANK = frozenset({"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                      "MASTER_PORT", "CUDA_VISIBLE_DEVICES", MARK_ENV})
KEPT = 4  # templates a process keeps (one per kind and environment), the least recently
# used ended
READY_TIMEOUT = 60.0  # seconds for a template to import torch (a loaded machine: ~10)
FORK_TIMEOUT = 10.0  # seconds for a fork's reply
PR_SET_NAME, PR_SET_CHILD_SUBREAPER, PR_GET_CHILD_SUBREAPER = 15, 36, 37
# Python 3.10 has no process_group=: a new session also makes a new process group.
OWN_PROCESS_GROUP: dict[str, Any] = (
    {"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True})
MESSAGE_MAX = 1 << 20
IDLE = 60.0  # seconds the templates stay after the last runner of the process shut down


class TemplateFailed(RuntimeError):
    """No rank could be forked: the caller spawns it instead."""


def _prctl(option: int, value: Any) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))


def _is_subreaper() -> bool:
    """This process is a child subreaper of its own (the application's setting)."""
    value = ctypes.c_int(0)
    _prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(value))
    return bool(value.value)


def _adoptive_children() -> tuple[set[int], bool]:
    """The children of this process's main thread, zombies included: the thread that
    the kernel hands orphans to (a process a thread forks is that thread's child); and
    whether only that thread's are known (False: a kernel without CONFIG_PROC_CHILDREN,
    every child of the process, read from every process's /proc entry)."""
    try:
        with open(f"/proc/self/task/{os.getpid()}/children") as f:
            return set(map(int, f.read().split())), True
    except OSError:
        import psutil
        return {child.pid for child in psutil.Process().children()}, False


def _boot_ticks() -> int:
    """Now, in the clock ticks since boot that /proc/PID/stat states start times in."""
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * os.sysconf("SC_CLK_TCK"))


def _started(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (None: gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rpartition(")")[2].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def reap_adopted(before: set[int], window: int, known: set[int]) -> list[int]:
    """After a fork's reply: the processes this one adopted while it was a subreaper
    for it (orphans of the application's own tree whose parent died meanwhile, the
    main thread's children now that were not before) are waited for, now or by a
    thread as each exits, so that none stays a zombie.  A child the application forked
    meanwhile is never touched: one started before the window opened (``window``
    ticks) was adopted; one started since was adopted only if the main thread, the
    only one that adopts, is this one (busy here, it forked nothing); elsewhere it is
    left alone.  The pids adopted."""
    children, by_thread = _adoptive_children()
    main_thread_here = by_thread and threading.get_native_id() == os.getpid()
    adopted = []
    for pid in children - before - known:
        started = _started(pid)
        if started is None or (started >= window and not main_thread_here):
            continue
        adopted.append(pid)
        with contextlib.suppress(ChildProcessError):
            if not os.waitpid(pid, os.WNOHANG)[0]:  # still running: reaped as it exits
                threading.Thread(target=_wait_quietly, args=(pid,), daemon=True,
                                 name="reactor-dist-reap").start()
    return adopted


def _wait_quietly(pid: int) -> None:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


class Template:
    """The runner's end of one template process (:meth:`fork` picks or starts one)."""

    _lock = threading.Lock()  # one fork at a time in a process: the subreaper flag is shared
    _kept: OrderedDict[tuple[str, ...], Template] = OrderedDict()
    _users = 0  # runners of this process started and not yet shut down
    _idle = IDLE
    _timer: threading.Timer | None = None  # ends the templates once nobody used them

    @classmethod
    def hold(cls) -> None:
        """A runner starts: the templates stay at least until it shuts down."""
        with cls._lock:
            cls._users += 1
            cls._cancel_timer()

    @classmethod
    def let_go(cls) -> None:
        """A runner shut down: after the last one, the templates end once they have been
        idle for ``_idle`` seconds (at once for 0)."""
        with cls._lock:
            cls._users = max(cls._users - 1, 0)
            if cls._users or not cls._kept:
                return
            cls._cancel_timer()
            if cls._idle <= 0:
                cls._close_all()
                return
            cls._timer = threading.Timer(cls._idle, cls._end_idle)
            cls._timer.daemon = True
            cls._timer.start()

    @classmethod
    def _end_idle(cls) -> None:
        with cls._lock:
            if not cls._users:
                cls._close_all()

    @classmethod
    def close_all(cls) -> None:
        """End every template of this process now (ranks already forked go on)."""
        with cls._lock:
            cls._cancel_timer()
            cls._close_all()

    @classmethod
    def set_idle(cls, seconds: float) -> None:
        with cls._lock:
            cls._idle = seconds

    @classmethod
    def _close_all(cls) -> None:
        while cls._kept:
            cls._kept.popitem(last=False)[1].close()

    @classmethod
    def _cancel_timer(cls) -> None:
        if cls._timer is not None:
            cls._timer.cancel()
            cls._timer = None

    @classmethod
    def fork(cls, env: dict[str, str], cwd: str, stdin_fd: int, output_fd: int,
             torch: bool) -> int:
        """Fork a rank with ``env`` (its whole environment) in ``cwd``, ``stdin_fd`` and
        ``output_fd`` as its stdin and its stdout/stderr, from a template that imported
        torch too where ``torch``; its pid, a child of this process."""
        modules = PRELOAD + TORCH if torch else PRELOAD
        # What a child inherits at its start and torch or numpy may read as they are
        # imported: those variables, the resource limits, the umask.
        key = (modules, tuple(sorted(f"{k}={v}" for k, v in env.items() if _read_at_import(k))),
               _limits(), _umask())
        with cls._lock:
            template = cls._kept.pop(key, None)
            if template is not None and not template.running():
                template.close()
                template = None
            if template is None:
                own = {k: v for k, v in env.items() if _read_at_import(k)}
                # What the ranks it forks show in /proc/<pid>/environ: their runner's pid.
                template = cls({**own, MARK_ENV: f"{os.getpid()}-template"}, modules)
                while len(cls._kept) >= KEPT:
                    cls._kept.popitem(last=False)[1].close()
            cls._kept[key] = template
            try:
                return template._fork(env, cwd, stdin_fd, output_fd)
            except TemplateFailed:
                cls._kept.pop(key, None)
                template.close()
                raise

    @classmethod
    def _forget(cls) -> None:
        """In a child forked from this process: its templates are not the child's (their
        sockets are closed here, not there), and the lock may have been held mid-fork."""
        cls._lock = threading.Lock()
        for template in cls._kept.values():
            template.sock.close()
        cls._kept = OrderedDict()
        cls._users, cls._timer = 0, None  # the parent's timer thread is not in the child

    @classmethod
    def pids(cls) -> set[int]:
        """The template processes of this process that are running."""
        with cls._lock:
            return {t.process.pid for t in cls._kept.values() if t.running()}

    @classmethod
    def fds(cls) -> set[int]:
        """This process's ends of its templates' sockets (one descriptor each)."""
        with cls._lock:
            return {t.sock.fileno() for t in cls._kept.values()}

    def __init__(self, env: dict[str, str], modules: tuple[str, ...]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock = ours
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-P", "-c", TEMPLATE_MAIN, *modules],
                env={**env, TEMPLATE_FD_ENV: str(theirs.fileno())},
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, pass_fds=[theirs.fileno()],
                close_fds=True, **OWN_PROCESS_GROUP)
        except OSError as e:
            ours.close()
            raise TemplateFailed(f"it could not be started: {e}") from None
        finally:
            theirs.close()
        self.ready = False
        self.seq = 0  # the last request's
        self.orphans: set[int] = set()  # forked for an interrupted request; ours to reap

    def running(self) -> bool:
        return self.process.poll() is None

    def _receive(self, timeout: float) -> ForkReply:
        ready, _, _ = select.select([self.sock], [], [], timeout)
        if not ready:
            raise TemplateFailed(f"it did not answer within {timeout:.0f} s")
        data = self.sock.recv(MESSAGE_MAX)
        if not data:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=1.0)
            raise TemplateFailed(f"it exited ({self.process.poll()})")
        return ForkReply.from_bytes(data)

    def _fork(self, env: dict[str, str], cwd: str, stdin_fd: int, output_fd: int) -> int:
        if not self.ready:  # its first reply, once it imported torch: seq 0
            self._receive(READY_TIMEOUT)
            self.ready = True
        self._reap_orphans()
        self.seq += 1
        request = ForkRequest(self.seq, env, cwd, sorted(os.sched_getaffinity(0)))
        try:
            own = _is_subreaper()  # the application's: kept, and what it adopts is its own
        except OSError as e:
            raise TemplateFailed(f"this process cannot adopt the rank ({e})") from None
        window = _boot_ticks()
        before = set() if own else _adoptive_children()[0]
        reply = None
        try:
            try:
                if not own:
                    _prctl(PR_SET_CHILD_SUBREAPER, 1)
            except OSError as e:
                raise TemplateFailed(f"this process cannot adopt the rank ({e})") from None
            try:
                socket.send_fds(self.sock, [request.to_bytes()], [stdin_fd, output_fd])
            except OSError as e:
                raise TemplateFailed(f"it could not be asked ({e})") from None
            # The replies to requests whose caller was interrupted (a KeyboardInterrupt)
            # come first: their ranks, adopted and never told anything (their stdin is
            # closed), exit, and are reaped later.
            while (reply := self._receive(FORK_TIMEOUT)).seq != request.seq:
                if reply.pid:
                    self.orphans.add(reply.pid)
        finally:
            if not own:
                _prctl(PR_SET_CHILD_SUBREAPER, 0)
                reap_adopted(before, window, self.orphans | ({reply.pid} if reply else set()))
        if not reply.pid:
            raise TemplateFailed(reply.error)
        if not _is_child(reply.pid):
            raise TemplateFailed(f"its rank (pid {reply.pid}) was not adopted")
        return reply.pid

    def _reap_orphans(self) -> None:
        for pid in list(self.orphans):
            with contextlib.suppress(ChildProcessError):
                if not os.waitpid(pid, os.WNOHANG)[0]:
                    continue
            self.orphans.discard(pid)

    def close(self) -> None:
        """Its socket closed: it exits (and is reaped here, within a second)."""
        self._reap_orphans()
        self.sock.close()
        try:
            self.process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


os.register_at_fork(after_in_child=Template._forget)


def set_rank_template_idle(seconds: float) -> None:
    """How long the rank templates of this process (the processes that fork ranks with
    torch already imported) stay after its last runner shut down: 60 s by default; 0:
    they end with it.  A runner started meanwhile uses them again."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or \
            not seconds >= 0:
        raise ValueError(f"seconds must be a number >= 0 (how long the rank templates stay "
                         f"after the last runner shut down; 0: they end with it), got "
                         f"{seconds!r}")
    Template.set_idle(float(seconds))


def close_rank_templates() -> None:
    """End the rank templates of this process now; the next rank to start starts a new
    one.  Ranks already running go on: they are the runner's children, not the
    template's."""
    Template.close_all()


def _read_at_import(name: str) -> bool:
    return name.startswith(READ_AT_IMPORT) and name not in PER_RANK


def _limits() -> tuple[tuple[int, int], ...]:
    return tuple(resource.getrlimit(getattr(resource, name)) for name in dir(resource)
                 if name.startswith("RLIMIT_"))


def _umask() -> str:
    with open("/proc/self/status") as f:
        return next((line for line in f if line.startswith("Umask:")), "")


def _is_child(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rpartition(")")[2].split()[1]) == os.getpid()
    except (OSError, ValueError, IndexError):
        return False


class Forked:
    """A forked rank, answering what local.RankProcess asks of a subprocess.Popen:
    its pid, its stdin and output pipes, its exit status once reaped."""

    def __init__(self, env: dict[str, str], cwd: str, torch: bool) -> None:
        stdin_r, stdin_w = os.pipe()
        output_r, output_w = os.pipe()
        try:
            self.pid = Template.fork(env, cwd, stdin_r, output_w, torch)
        except BaseException:
            os.close(stdin_w)
            os.close(output_r)
            raise
        finally:
            os.close(stdin_r)
            os.close(output_w)
        self.args = ["reactor_dist.rank", f"forked from a template (pid {self.pid})"]
        self.stdin = os.fdopen(stdin_w, "wb")
        self.stdout = os.fdopen(output_r, "rb")
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """Its exit code (negative: the signal), reaping it; None while it runs."""
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                return None
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.005)
        return cast(int, self.returncode)


# -- the template process ------------------------------------------------------------------

def serve() -> None:
    """The template's loop: import torch, then fork a rank per request until the runner's
    end closes.  Returns only in a forked rank, set up as a spawned one would be."""
    sock = socket.socket(fileno=int(os.environ.pop(TEMPLATE_FD_ENV)))
    parent = os.pidfd_open(os.getppid())
    own_name = _name()
    _prctl(PR_SET_NAME, TEMPLATE_NAME.encode())
    for module in sys.argv[1:]:  # the point of it
        importlib.import_module(module)
    sock.send(ForkReply(0, 0).to_bytes())
    while True:
        ready, _, _ = select.select([sock, parent], [], [])
        if parent in ready:
            os._exit(0)
        try:
            data, fds, _, _ = socket.recv_fds(sock, MESSAGE_MAX, 2)
        except OSError:
            os._exit(0)
        if not data:
            os._exit(0)  # the runner's end closed
        request = ForkRequest.from_bytes(data)
        pid = _fork_rank(sock, parent, fds, own_name)
        if pid == 0:
            _become_rank(request, fds, own_name)
            return
        for fd in fds:
            os.close(fd)
        sock.send(ForkReply(request.seq, max(pid, 0),
                            "" if pid > 0 else "fork failed").to_bytes())


def _fork_rank(sock: socket.socket, parent: int, fds: list[int], own_name: str) -> int:
    """Fork twice; the rank's pid here (-1: a fork failed), 0 in the rank.  The
    intermediate exits at once, which hands the rank to the runner (a subreaper now)."""
    report_r, report_w = os.pipe()
    try:
        intermediate = os.fork()
    except OSError:
        os.close(report_r)
        os.close(report_w)
        return -1
    if intermediate == 0:
        os.close(report_r)
        try:
            pid = os.fork()
        except OSError:
            os._exit(1)
        if pid == 0:
            os.close(report_w)
            sock.close()
            os.close(parent)
            return 0
        os.write(report_w, struct.pack("i", pid))
        os._exit(0)
    os.close(report_w)
    with os.fdopen(report_r, "rb") as report:
        data = report.read(4)
    os.waitpid(intermediate, 0)
    return struct.unpack("i", data)[0] if len(data) == 4 else -1


def _become_rank(request: ForkRequest, fds: list[int], own_name: str) -> None:
    stdin_fd, output_fd = fds
    os.setpgid(0, 0)
    os.dup2(stdin_fd, 0)
    os.dup2(output_fd, 1)
    os.dup2(output_fd, 2)
    os.close(stdin_fd)
    os.close(output_fd)
    _prctl(PR_SET_NAME, own_name.encode())
    os.environ.clear()
    os.environ.update(request.env)
    os.chdir(request.cwd)
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, request.cpus)  # the runner's now, as a spawned rank's
    sys.argv[1:] = []
    # Else every rank would draw what the template would have drawn.
    if "torch" in sys.modules:
        sys.modules["torch"].seed()
    sys.modules["numpy"].random.seed()
    for name in [n for n in sys.modules if n == "reactor_dist" or n.startswith("reactor_dist.")]:
        del sys.modules[name]  # imported anew, under the rank's environment


def _name() -> str:
    with open("/proc/self/comm") as f:
        return f.read().strip()
