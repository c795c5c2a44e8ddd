"""The runner's side of the bus: the rank processes, the sockets, the shm pools.

Data flow of one ``generate(x)``::

    caller thread                                  rank r (x world_size)
    ------------------------------------------     ---------------------------------
    encode x: pickle-5 stream + buffers;
      big buffers -> one input segment (1 copy)
    PUB  [mac|hdr(seq, descriptors, stream)] ----> SUB: verify MAC, map input segment
                                                    copy-on-write, unpickle, generate()
    recv(PULL) <---------------------------------- PUSH [mac|hdr(seq, status)|...]
      reply of another seq: bookkeeping only        rank 0 alone adds its result: big
      death notice (DeathWatch thread on the          buffers copied into a warm result
        pidfds): WorkerCrashed at once                segment (or none: shared_empty)
      deadline (RCVTIMEO): WorkerTimeout (+ stacks)
    decode rank 0's result: arrays view the
      result segment; dropping them releases it
      (told to rank 0 with the next command)

Segments: the runner owns the input pool, rank 0 owns the result pool; the
other side maps them.  Releases and retirements ride on the next message the
other way ("rel"/"iret" on commands, "irel"/"ret" on replies).
"""

from __future__ import annotations

import collections
import contextlib
import os
import pickle
import select
import shutil
import signal
import socket
import sys
import tempfile
import time
import weakref
from typing import Any

import numpy as np
import psutil
import zmq

from . import shm, transfer, wire
from .errors import WorkerCrashed, WorkerTimeout, rebuild_exception
from .process import DeathWatch, RankProcess, end_ranks, wait_all_exit

SLICE = 0.02  # between handshake pings; between death checks when no death watch runs
# A wait may end this much before or after its deadline: a call's second receive then
# keeps the first one's RCVTIMEO instead of setting it anew.
TIMEOUT_SLACK_MS = 5
FOREVER_MS = 1 << 62
STACK_DUMP_WAIT = 0.5
RECEIVED = wire.REPLIES | {wire.DEATH}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reclaim_dead_ipc_dirs() -> None:
    """Private directories of runners killed together with their ranks: their owner's
    pid is in the name; a dead owner's directory is ours to remove (never a live one's)."""
    for base in {tempfile.gettempdir(), "/tmp"}:
        try:
            names = os.listdir(base)
        except OSError:
            continue
        for name in names:
            parts = name.split("-")
            if len(parts) == 4 and name.startswith("reactor-dist-") and parts[2].isdigit():
                path = os.path.join(base, name)
                with contextlib.suppress(OSError):
                    if os.stat(path).st_uid == os.getuid() and \
                            not psutil.pid_exists(int(parts[2])):
                        shutil.rmtree(path, ignore_errors=True)


def _private_dir() -> str:
    prefix = f"reactor-dist-{os.getpid()}-"
    path = tempfile.mkdtemp(prefix=prefix)  # mode 0700
    if len(path) > 90:  # ipc:// paths are limited to ~107 bytes
        os.rmdir(path)
        path = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    return path


class RankGroup:
    """Processes, sockets and pools of one runner; raises the transport-level errors."""

    def __init__(self, *, worker: dict[str, Any], world_size: int, load_kwargs: dict[str, Any],
                 init_process_group: bool, device: str, gpus: list[int] | None,
                 env: dict[str, str], launch_prefix: list[str], shm_dir: str,
                 keep_free: int, start_timeout: float, shutdown_grace: float) -> None:
        self.world_size = world_size
        self.secret = os.urandom(wire.SECRET_SIZE)
        self.channel = wire.Channel(self.secret)  # the caller's thread, under the runner lock
        self.shm_dir = shm_dir
        self.shm_prefix = shm.new_runner_prefix()
        self.shutdown_grace = shutdown_grace
        self.owner_pid = os.getpid()  # a forked child must never tear down our ranks
        self.seq = 0
        self.ranks: list[RankProcess] = []
        self.inputs = shm.SlotPool(shm_dir, self.shm_prefix, "in", keep_free=keep_free)
        self.result_maps: dict[str, shm.Segment] = {}
        self.released: collections.deque[str] = collections.deque()  # result segments let go
        self.inputs_retired: list[str] = []
        self.ctx: zmq.Context | None = None
        self.pub_open = False  # a multipart command is half-sent (interrupted)
        self.pull_timeout = -1  # the PULL socket's RCVTIMEO, in ms
        self.death_watch: DeathWatch | None = None
        self.ipc_dir: str | None = None
        self._spec = dict(worker=worker, load_kwargs=pickle.dumps(load_kwargs, protocol=5),
                          init_process_group=init_process_group, device=device,
                          start_timeout=start_timeout, keep_free=keep_free)
        self._env, self._gpus, self._launch_prefix = env, gpus, launch_prefix

    # -- start ---------------------------------------------------------------------------
    def start(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        shm.reclaim_dead_owners(self.shm_dir)
        _reclaim_dead_ipc_dirs()
        self.ipc_dir = _private_dir()
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        # One call at a time keeps each rank's queue a few messages deep; the bound only
        # stops a stray subscriber that never reads from growing our memory.
        self.pub.setsockopt(zmq.SNDHWM, 1000)
        self.pub.setsockopt(zmq.LINGER, 0)
        cmd_addr = f"ipc://{self.ipc_dir}/cmd"
        self.pub.bind(cmd_addr)
        self.pub_send = wire.direct_send(self.pub)
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        reply_addr = f"ipc://{self.ipc_dir}/reply"
        self.pull.bind(reply_addr)
        # The death watch's notices arrive on the PULL socket too, so a call's wait is
        # one blocking receive.
        self.death_addr = f"inproc://reactor-dist-deaths-{id(self):x}"
        self.pull.bind(self.death_addr)
        self.death_fds: dict[int, int] = {}
        self.death_poll = select.poll()  # the same pidfds, for a zero-wait check
        self.launcher_fds: list[int] = []
        # For models that form their own group (init_process_group=False): one port for
        # all ranks. With our group, rank 0's store binds port 0 and INIT carries its port.
        self.master_port = _free_port()
        for rank in range(self.world_size):
            self._spawn(rank, cmd_addr, reply_addr)

        # Handshake: PING until every rank answered, so no later command is lost to a
        # subscription that has not reached the PUB socket yet (slow joiner).
        pongs = self.collect(wire.PONG, 0, deadline - time.monotonic(), "start()",
                             tick=lambda: self.publish({"k": wire.PING, "s": 0}),
                             stated_timeout=timeout)
        for rank, (header, _) in pongs.items():
            self._watch_launcher(rank, header.get("pid"))
        port = pongs[0][0].get("port") or 0
        self.death_watch = DeathWatch(self.death_fds, self._tell_death)
        self.publish({"k": wire.INIT, "s": 0, "port": port})
        ready = self.collect(wire.READY, 0, deadline - time.monotonic(), "start()",
                             first_error=True, stated_timeout=timeout)
        for rank, (header, body) in ready.items():
            if header.get("st") == wire.RAISED:
                raise rebuild_exception(header["e"], body[0] if body else None, rank)

    def _spawn(self, rank: int, cmd_addr: str, reply_addr: str) -> None:
        env = dict(os.environ)
        env.update(self._env)
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join(
            [package_root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(self.world_size),
                   LOCAL_WORLD_SIZE=str(self.world_size), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(self.master_port), PYTHONUNBUFFERED="1")
        if self._gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in self._gpus)
        boot = dict(self._spec, rank=rank, world_size=self.world_size, secret=self.secret,
                    cmd_addr=cmd_addr, reply_addr=reply_addr, runner_pid=os.getpid(),
                    shm_dir=self.shm_dir, shm_prefix=self.shm_prefix, sys_path=list(sys.path))
        data = pickle.dumps(boot, protocol=5)
        prefix = [part.replace("{rank}", str(rank)) for part in self._launch_prefix]
        cmd = prefix + [sys.executable, "-m", "reactor_dist.launcher"]
        proc = RankProcess(rank, cmd, env, os.getcwd(), len(data).to_bytes(8, "little") + data)
        self.ranks.append(proc)
        if proc.pidfd is not None:
            self._watch_fd(proc.pidfd, rank)

    def _watch_launcher(self, rank: int, pid: Any) -> None:
        """With a launch_prefix the launcher may be a grandchild: watch it as well."""
        proc = self.ranks[rank]
        if not isinstance(pid, int) or pid == proc.pid:
            return
        proc.launcher_pid = pid
        with contextlib.suppress(OSError):
            fd = os.pidfd_open(pid)
            self.launcher_fds.append(fd)
            self._watch_fd(fd, rank)

    def _watch_fd(self, fd: int, rank: int) -> None:
        self.death_fds[fd] = rank
        self.death_poll.register(fd, select.POLLIN)

    def _tell_death(self, ranks: list[int]) -> None:
        """In the death-watch thread: wake the caller's wait with a notice."""
        if self.ctx is None:
            return
        with contextlib.suppress(zmq.ZMQError):
            push = self.ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 1000)
            push.connect(self.death_addr)
            wire.Channel(self.secret).send(push.send, {"k": wire.DEATH, "s": 0, "r": ranks[0]})
            push.close()

    # -- the wire ---------------------------------------------------------------------------
    def publish(self, header: dict[str, Any], body: list | tuple = ()) -> None:
        header["r"] = -1  # commands are for every rank
        frames = self.channel.pack(header, body)
        if self.pub_open:
            # A Ctrl-C cut the last command short: end that message with an empty frame
            # (the ranks reject it: its MAC fails) so it cannot swallow this one.
            self.pub.send(b"")
        self.pub_open = True
        wire.send(self.pub_send, frames)
        self.pub_open = False

    def collect(self, kind: str, seq: int, timeout: float | None, what: str,
                tick=None, first_error: bool = False,
                stated_timeout: float | None = None) -> dict[int, tuple[dict, list]]:
        """Wait for ``kind``/``seq`` from every rank; WorkerCrashed on a death,
        WorkerTimeout at the deadline.  With ``first_error`` a RAISED reply ends
        the wait at once (start-up: a failed load() makes the rest pointless).

        This loop is most of what an empty call costs the caller, so it stays lean:
        one blocking receive per message, which the death watch's notice also wakes.
        Without the watch (the handshake, or a rank without a pidfd) it waits in
        short slices and looks for deaths between them."""
        replies: dict[int, tuple[dict, list]] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        watch_by_timer = len(self.death_fds) < len(self.ranks)
        sliced = tick is not None or watch_by_timer or self.death_watch is None
        while len(replies) < self.world_size:
            if sliced:
                if tick is not None:
                    tick()
                dead = self.any_dead() if watch_by_timer else self.idle_deaths()
                if dead:
                    raise self.crashed(dead, what)
                wait_ms = self._sliced_wait_ms(deadline)
            elif deadline is None:
                wait_ms = -1
            else:
                wait_ms = int(max(0.0, deadline - time.monotonic()) * 1000) + 1
            message = self.receive(wait_ms)
            if message is not None:
                header, body = message
                if header["k"] == kind and header["s"] == seq and header["r"] not in replies:
                    replies[header["r"]] = message
                    if first_error and header.get("st") == wire.RAISED:
                        return {header["r"]: message}
                elif header["k"] == wire.DEATH:
                    raise self.crashed(self.idle_deaths() or [header["r"]], what)
                elif header["k"] == wire.REPLY and header["s"] != seq:
                    self.discard_stale(header)
            if deadline is not None and len(replies) < self.world_size and \
                    time.monotonic() >= deadline:
                silent = [r for r in range(self.world_size) if r not in replies]
                raise self.timed_out(silent, stated_timeout or timeout, what, replies)
        return replies

    @staticmethod
    def _sliced_wait_ms(deadline: float | None) -> int:
        wait = SLICE if deadline is None else min(max(0.0, deadline - time.monotonic()), SLICE)
        return int(wait * 1000) + 1

    def receive(self, wait_ms: int) -> tuple[dict, list] | None:
        """The next message if it is an authentic reply or death notice (its releases
        applied); None when ``wait_ms`` passed first or the message is not ours (dropped
        unread)."""
        want = wait_ms if wait_ms >= 0 else FOREVER_MS
        have = self.pull_timeout if self.pull_timeout >= 0 else FOREVER_MS
        if abs(want - have) > TIMEOUT_SLACK_MS:  # most calls keep the last setting
            self.pull.setsockopt(zmq.RCVTIMEO, wait_ms)
            self.pull_timeout = wait_ms
        try:
            header, body = self.channel.recv(self.pull)
        except (zmq.Again, wire.ProtocolError):
            return None
        if header["k"] not in RECEIVED or not 0 <= header["r"] < self.world_size:
            return None
        if "irel" in header or "ret" in header:
            self.bookkeep(header)
        return header, body

    def bookkeep(self, header: dict[str, Any]) -> None:
        """Segment releases that ride on every reply, whatever call it answers."""
        for name in header.get("irel") or ():
            if isinstance(name, str):
                self.inputs_retired.extend(self.inputs.let_go(name, header["r"]))
        for name in header.get("ret") or ():
            seg = self.result_maps.pop(name, None) if isinstance(name, str) else None
            if seg is not None:
                seg.close(unlink=True)

    def discard_stale(self, header: dict[str, Any]) -> None:
        """An answer to an older (interrupted) call: hand its result segments back."""
        names = {d[1] for d in header.get("d") or () if isinstance(d, list) and len(d) == 5
                 and d[0] == transfer.SEGMENT and isinstance(d[1], str)}
        self.released.extend(names)

    # -- calls ------------------------------------------------------------------------------
    def send_call(self, method: str, value: Any = None) -> int:
        """Encode and publish one call; raises (having sent nothing) when it can't."""
        header: dict[str, Any] = {"k": wire.CALL, "m": method}
        body: list = [b""]
        if method == "generate":
            try:
                descriptors, body, _ = transfer.encode(
                    value, self.inputs, "the input of generate()", holders=range(self.world_size))
            except shm.SharedSlotAllocationFailed:
                raise
            except Exception as exc:
                raise TypeError(
                    f"the input of generate() cannot be pickled ({type(exc).__name__}: {exc}); "
                    f"inputs must pickle: plain data, numpy arrays, CPU tensors, module-level "
                    f"classes"
                ) from exc
            if descriptors:
                header["d"] = descriptors
        # From here on the command may have reached the ranks, even if publish() is
        # interrupted: the sequence number, the segments and the releases count as sent
        # (an interrupted call's segments stay held until shutdown rather than risk
        # handing out memory a rank may still read).
        self.seq += 1
        header["s"] = self.seq
        if self.released:
            header["rel"] = [self.released.popleft() for _ in range(len(self.released))]
        if self.inputs_retired:
            header["iret"], self.inputs_retired = self.inputs_retired, []
        self.publish(header, body)
        return self.seq

    def result_base(self, name: str) -> np.ndarray:
        seg = self.result_maps.get(name)
        if seg is None:
            if "/" in name or not name.startswith(self.shm_prefix + "."):
                raise ValueError(f"result names a foreign segment {name!r}")
            seg = self.result_maps[name] = shm.Segment.open(self.shm_dir, name)
        base = np.frombuffer(seg.mm, np.uint8)
        weakref.finalize(base, self.released.append, name)
        return base

    # -- failures ---------------------------------------------------------------------------
    def crashed(self, dead: list[int], what: str) -> WorkerCrashed:
        reports = "\n".join(self.ranks[r].crash_report() for r in dead)
        return WorkerCrashed(f"rank {', '.join(map(str, dead))} died during {what}: {reports}")

    def timed_out(self, silent: list[int], timeout: float | None, what: str,
                  replies: dict[int, tuple[dict, list]]) -> WorkerTimeout:
        procs = [self.ranks[r] for r in silent]
        seen = {p.rank: p.lines_seen for p in procs}
        for p in procs:  # faulthandler in the rank prints every thread's stack
            with contextlib.suppress(OSError):
                os.kill(p.launcher_pid, signal.SIGUSR1)
        # Wait for the dumps: until each silent rank printed and then fell quiet.
        deadline = time.monotonic() + STACK_DUMP_WAIT
        while time.monotonic() < deadline:
            time.sleep(0.01)
            if all(p.lines_seen > seen[p.rank] and time.monotonic() - p.last_output > 0.03
                   for p in procs):
                break
        raised = [f"rank {r} raised {h['e']['type']}" for r, (h, _) in sorted(replies.items())
                  if h.get("st") == wire.RAISED and isinstance(h.get("e"), dict)]
        note = f" ({'; '.join(raised)}: the silent ranks may wait for it in a collective)" \
            if raised else ""
        stacks = "\n".join(
            f"rank {r} (pid {self.ranks[r].pid}), last output:\n" +
            "\n".join(f"    {line}" for line in self.ranks[r].last_lines(30)) for r in silent)
        return WorkerTimeout(
            f"no answer from rank {', '.join(map(str, silent))} within {timeout:g} s "
            f"during {what}{note}; their stacks:\n{stacks}")

    def any_dead(self) -> list[int]:
        return [r.rank for r in self.ranks if not r.alive()]

    def idle_deaths(self) -> list[int]:
        """The ranks that have died: one zero-wait poll of their pidfds (a waitpid per
        rank where a pidfd is missing); no system call at all while the death watch
        has seen none."""
        if len(self.death_fds) < len(self.ranks):
            return self.any_dead()
        if self.death_watch is not None and not self.death_watch.fired:
            return []
        fired = self.death_poll.poll(0)
        return sorted({self.death_fds[fd] for fd, _ in fired}) if fired else []

    # -- end --------------------------------------------------------------------------------
    def close(self, graceful: bool) -> None:
        """End every process and remove every file; safe to call in any state, twice."""
        if os.getpid() != self.owner_pid:
            return
        if self.death_watch is not None:
            # Exits are expected from here on (and the watch must end before end_ranks
            # closes the pidfds it watches).
            self.death_watch.stop()
            self.death_watch = None
        if graceful and self.ranks and not self.any_dead():
            with contextlib.suppress(zmq.ZMQError):
                self.publish({"k": wire.SHUTDOWN, "s": self.seq + 1})
            wait_all_exit(self.ranks, self.shutdown_grace)
        end_ranks(self.ranks)
        self.ranks = []
        for fd in getattr(self, "launcher_fds", ()):
            os.close(fd)  # the ranks' own pidfds were closed by end_ranks
        self.launcher_fds, self.death_fds = [], {}
        self.death_poll = select.poll()
        if self.ctx is not None:
            self.pub.close(linger=0)
            self.pull.close(linger=0)
            self.ctx.term()
            self.ctx = None
        if self.ipc_dir is not None:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)
            self.ipc_dir = None
        self.inputs.close()
        for seg in self.result_maps.values():
            seg.close()
        self.result_maps.clear()
        shm.remove_prefix(self.shm_dir, self.shm_prefix)
