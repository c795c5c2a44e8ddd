"""The runner's side of one call: encode, publish, collect, decode.

Data flow of one ``generate(x)``::

    caller thread (Transport.call)                 rank r (x world_size, rank.py)
    ------------------------------------------     ---------------------------------
    encode x: pickle-5 stream + buffers;
      big buffers -> one input segment (1 copy)
    Bus.publish Kind.CALL ----------------------------> SUB: verify MAC, map input segment
                                                    copy-on-write, unpickle, generate()
    Bus.receive (PULL) <-------------------------- PUSH Kind.REPLY (status, error)
      a reply to an older call: its result          rank 0 alone adds its result: big
        segments released, nothing else             buffers copied into a warm result
      Kind.DEATH (from the death watch): WorkerCrashed   segment (or none: shared_empty)
      deadline: WorkerTimeout with the silent
        ranks' stacks
    decode rank 0's result (arrays view the
      result segment); per-rank Outcomes
    -> runner: outcome.judge -> result or error

Segments: the runner's input ledger and rank 0's result ledger
(:mod:`reactor_dist.ledger`); releases and retirements ride on the next message
the other way (Field.RELEASED / Field.RETIRED).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import psutil
import zmq

from . import shm, transfer
from .bus import Bus
from .errors import (
    MainGuardMissing,
    WorkerCrashed,
    WorkerTimeout,
    rebuild_exception,
    timeout_error,
    type_name,
)
from .ledger import Ledger, Mapped
from .outcome import RETURNED, Outcome
from .processes import Ranks
from .protocol import (
    IPC_DIR_PREFIX,
    SECRET_SIZE,
    Bootstrap,
    ErrorRecord,
    Field,
    Kind,
    Method,
    Status,
    WorkerRef,
    ipc_dir_owner,
    segments_of,
    torchrun_env,
)

PING_EVERY = 0.02  # handshake: until every rank answered (PUB/SUB's slow joiner)
Replies = dict[int, tuple[dict, list]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reclaim_dead_ipc_dirs() -> None:
    """Private directories of runners killed together with their ranks: their owner's
    pid is in the name; a dead owner's directory is ours to remove (never a live one's)."""
    for base in {tempfile.gettempdir(), "/tmp"}:
        try:
            names = os.listdir(base)
        except OSError:
            continue
        for name in names:
            owner = ipc_dir_owner(name)
            if owner is None:
                continue
            path = os.path.join(base, name)
            with contextlib.suppress(OSError):
                if os.stat(path).st_uid == os.getuid() and not psutil.pid_exists(owner):
                    shutil.rmtree(path, ignore_errors=True)


def private_dir() -> str:
    prefix = f"{IPC_DIR_PREFIX}{os.getpid()}-"
    path = tempfile.mkdtemp(prefix=prefix)  # mode 0700
    if len(path) > 90:  # ipc:// paths are limited to ~107 bytes
        os.rmdir(path)
        path = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    return path


class Transport:
    """Processes, bus and segments of one runner; raises the transport's errors
    (WorkerCrashed, WorkerTimeout) and judges nothing else."""

    def __init__(self, *, worker: WorkerRef, world_size: int, load_kwargs: dict[str, Any],
                 init_process_group: bool, device: str, gpus: list[int] | None,
                 env: dict[str, str], launch_prefix: list[str], shm_dir: str,
                 keep_free: int, start_timeout: float, shutdown_grace: float) -> None:
        self.world_size = world_size
        self.secret = os.urandom(SECRET_SIZE)
        self.shm_dir = shm_dir
        self.shm_prefix = shm.new_runner_prefix()
        self.shutdown_grace = shutdown_grace
        self.owner_pid = os.getpid()  # a forked child must never tear down our ranks
        self.seq = 0
        # Ranks that have not answered an interrupted call (Ctrl-C while waiting): rank ->
        # the last call it answered.  Its next answers are late ones; see wait_idle().
        self.owing: dict[int, int] = {}
        self.interrupted = 0  # the latest call whose wait was interrupted
        self.devices: list[str] = []  # each rank's device, once started
        self.inputs = Ledger(shm_dir, self.shm_prefix, "in", keep_free=keep_free)
        self.results = Mapped(lambda name: shm.Segment.open(shm_dir, name), self._ours)
        self.bus: Bus | None = None
        self.ranks: Ranks | None = None
        self.ipc_dir: str | None = None
        self._worker, self._load_kwargs = worker, pickle.dumps(load_kwargs, protocol=5)
        self._init_process_group, self._device = init_process_group, device
        self._start_timeout, self._keep_free = start_timeout, keep_free
        self._env, self._gpus, self._launch_prefix = env, gpus, launch_prefix

    def _ours(self, name: str) -> bool:
        return "/" not in name and name.startswith(self.shm_prefix + ".")

    # -- start ---------------------------------------------------------------------------
    def start(self, timeout: float) -> None:
        """Spawn every rank, handshake, form the group, load(); raises what load() raised."""
        deadline = time.monotonic() + timeout
        shm.reclaim_dead_owners(self.shm_dir)
        reclaim_dead_ipc_dirs()
        self.ipc_dir = private_dir()
        self.bus = Bus(self.secret, self.ipc_dir, self.world_size)
        self.ranks = Ranks(self.bus.tell_death)
        # For models that form their own group (init_process_group=False): one port for
        # all ranks. With our group, rank 0's store binds port 0 and Kind.INIT carries its port.
        master_port = free_port()
        for rank in range(self.world_size):
            self._spawn(rank, master_port)
        bus = self.bus
        pongs = self.collect(Kind.PONG, 0, deadline - time.monotonic(), "start()",
                             ping=lambda: bus.publish({Field.KIND: Kind.PING, Field.SEQ: 0}),
                             stated_timeout=timeout)
        for rank, (header, _) in pongs.items():
            self.ranks.found_launcher(rank, header.get(Field.PID))
        store_port = pongs[0][0].get(Field.PORT) or 0
        bus.publish({Field.KIND: Kind.INIT, Field.SEQ: 0, Field.PORT: store_port})
        ready = self.collect(Kind.READY, 0, deadline - time.monotonic(), "start()",
                             first_error=True, stated_timeout=timeout)
        self.devices = [str(ready[r][0].get(Field.DEVICE)) for r in sorted(ready)]
        for rank, (header, body) in ready.items():
            if header.get(Field.STATUS) == Status.RAISED:
                exc = rebuild_exception(ErrorRecord.parse(header.get(Field.ERROR)),
                                        body[0] if body else None, rank)
                if isinstance(exc, MainGuardMissing):
                    raise exc from None  # its own message says all; the rank's stack is noise
                raise exc

    def _spawn(self, rank: int, master_port: int) -> None:
        env = dict(os.environ)
        env.update(self._env)
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join(
            [package_root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        env.update(torchrun_env(rank, self.world_size, master_port), PYTHONUNBUFFERED="1")
        if self._gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in self._gpus)
        assert self.bus is not None and self.ranks is not None
        boot = Bootstrap(
            rank=rank, world_size=self.world_size, secret=self.secret,
            cmd_addr=self.bus.cmd_addr, reply_addr=self.bus.reply_addr,
            runner_pid=os.getpid(), shm_dir=self.shm_dir, shm_prefix=self.shm_prefix,
            worker=self._worker, load_kwargs=self._load_kwargs,
            init_process_group=self._init_process_group, device=self._device,
            start_timeout=self._start_timeout, keep_free=self._keep_free,
            sys_path=list(sys.path))
        prefix = [part.replace("{rank}", str(rank)) for part in self._launch_prefix]
        cmd = prefix + [sys.executable, "-m", "reactor_dist.rank"]
        self.ranks.spawn(rank, cmd, env, boot.to_bytes())

    # -- one call ------------------------------------------------------------------------
    def call(self, method: str, value: Any, timeout: float | None) -> list[Outcome]:
        """Run ``method(value)`` on every rank: one Outcome per rank, in rank order.

        Raises before sending (TypeError: the input does not pickle;
        SharedSlotAllocationFailed), or WorkerCrashed / WorkerTimeout."""
        assert self.ranks is not None and self.bus is not None
        if self.ranks.watch.fired:
            dead = self.ranks.dead()
            if dead:
                raise self.crashed(dead, "an idle moment between calls")
        header: dict[str, Any] = {Field.KIND: Kind.CALL, Field.METHOD: method}
        body: list = [b""]
        if method == Method.GENERATE:
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
                header[Field.DESCRIPTORS] = descriptors
        # From here on the command may have reached the ranks, even if publish() is
        # interrupted: the sequence number, the segments and the releases count as sent
        # (an interrupted call's segments stay held until shutdown rather than risk
        # handing out memory a rank may still read).
        self.seq = seq = self.seq + 1
        header[Field.SEQ] = seq
        released = self.results.take_released()
        if released:
            header[Field.RELEASED] = released
        retired = self.inputs.take_retired()
        if retired:
            header[Field.RETIRED] = retired
        self.bus.publish(header, body)
        replies: Replies = {}
        try:
            self.collect(Kind.REPLY, seq, timeout, f"{method}() (call {seq})", replies=replies)
        except (WorkerCrashed, WorkerTimeout):
            raise
        except BaseException:  # interrupted (Ctrl-C): the ranks still run this call
            self.interrupted = seq
            for rank in range(self.world_size):
                if rank in replies:
                    self.owing.pop(rank, None)
                else:
                    self.owing.setdefault(rank, seq - 1)
            raise
        if self.owing:
            self.owing.clear()  # every rank answered this call, so every earlier one
        return self.outcomes(method, replies)

    def wait_idle(self, timeout: float | None) -> bool:
        """Until every rank answered every interrupted call: True, or False at the
        deadline (nothing else changes).  WorkerCrashed when a rank dies meanwhile."""
        assert self.bus is not None
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.owing:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            message = self.bus.receive(-1 if left is None else int(left * 1000) + 1)
            if message is not None:
                if Field.RELEASED in message[0] or Field.RETIRED in message[0]:
                    self._apply_ledger_fields(message[0])
                self._other(message[0], -1, "wait_idle()")
        return True

    def _other(self, header: dict[str, Any], seq: int, what: str) -> None:
        """A message that is not the awaited answer: a death notice (WorkerCrashed), or
        the answer to an older (interrupted) call, whose segments are handed back."""
        assert self.ranks is not None
        if header[Field.KIND] == Kind.DEATH:
            raise self.crashed(self.ranks.dead() or [header[Field.RANK]], what)
        if header[Field.KIND] == Kind.REPLY and header[Field.SEQ] != seq:
            self._late_reply(header)

    def _late_reply(self, header: dict[str, Any]) -> None:
        """Hand a late answer's segments back; its rank has finished that call."""
        self.results.release(segments_of(header.get(Field.DESCRIPTORS)))
        rank, seq = header[Field.RANK], header[Field.SEQ]
        if rank in self.owing and isinstance(seq, int):
            self.owing[rank] = max(self.owing[rank], seq)
            if self.owing[rank] >= self.interrupted:
                del self.owing[rank]

    def outcomes(self, method: str, replies: Replies) -> list[Outcome]:
        """Every rank's Outcome; rank 0's result is decoded only when every rank returned
        (else it is released unread: the call fails whatever it holds)."""
        if [h.get(Field.STATUS) for h, _ in replies.values()].count(Status.OK) == self.world_size:
            first = RETURNED
            if method == Method.GENERATE:
                header, body = replies[0]
                try:
                    first = Outcome(Status.OK, transfer.decode(header.get(Field.DESCRIPTORS), body,
                                                        self.results.base))
                except Exception as exc:
                    if hasattr(exc, "add_note"):  # Python 3.11+
                        exc.add_note("(while unpickling rank 0's result in the caller; the "
                                     "runner stays healthy)")
                    first = Outcome(Status.UNDELIVERABLE, None, exc, type_name(exc))
            return [first] + [RETURNED] * (self.world_size - 1)
        outcomes = []
        for rank in range(self.world_size):
            header, body = replies[rank]
            status = header.get(Field.STATUS)
            if status == Status.OK:
                self.results.release(segments_of(header.get(Field.DESCRIPTORS)))
                outcomes.append(RETURNED)
                continue
            record = ErrorRecord.parse(header.get(Field.ERROR))
            error = rebuild_exception(record, (body[0] if body else b"") or None, rank)
            if status != Status.UNDELIVERABLE:
                status = Status.RAISED
            outcomes.append(Outcome(status, None, error, record.type))
        return outcomes

    def collect(self, kind: str, seq: int, timeout: float | None, what: str,
                ping: Callable[[], None] | None = None, first_error: bool = False,
                stated_timeout: float | None = None, replies: Replies | None = None) -> Replies:
        """Wait for ``kind``/``seq`` from every rank; WorkerCrashed on a death notice,
        WorkerTimeout at the deadline.  With ``first_error`` a Status.RAISED answer ends the
        wait at once (start-up: a failed load() makes the rest pointless); ``ping`` is
        repeated every PING_EVERY while waiting; ``replies`` (filled in place) shows an
        interrupted caller who answered.

        This loop is most of what an empty call costs the caller, so it stays lean:
        one blocking receive per message, which the death watch's notice also wakes."""
        assert self.bus is not None and self.ranks is not None
        receive = self.bus.receive
        if replies is None:
            replies = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(replies) < self.world_size:
            if ping is not None:
                ping()
                left = PING_EVERY if deadline is None else \
                    min(max(0.0, deadline - time.monotonic()), PING_EVERY)
                wait_ms = int(left * 1000) + 1
            elif deadline is None:
                wait_ms = -1
            else:
                wait_ms = int(max(0.0, deadline - time.monotonic()) * 1000) + 1
            message = receive(wait_ms)
            if message is not None:
                header, body = message
                if Field.RELEASED in header or Field.RETIRED in header:
                    self._apply_ledger_fields(header)
                rank = header[Field.RANK]
                if header[Field.KIND] == kind and header[Field.SEQ] == seq and rank not in replies:
                    replies[rank] = message
                    if first_error and header.get(Field.STATUS) == Status.RAISED:
                        return {rank: message}
                else:
                    self._other(header, seq, what)
            if deadline is not None and len(replies) < self.world_size and \
                    time.monotonic() >= deadline:
                silent = [r for r in range(self.world_size) if r not in replies]
                raise self.timed_out(silent, stated_timeout or timeout, what, replies)
        return replies

    def _apply_ledger_fields(self, header: dict[str, Any]) -> None:
        """A rank's Field.RELEASED input segments and rank 0's Field.RETIRED result segments."""
        rank = header[Field.RANK]
        for name in header.get(Field.RELEASED) or ():
            if isinstance(name, str):
                self.inputs.release(name, rank)
        self.results.unmap(header.get(Field.RETIRED) or ())

    # -- failures ------------------------------------------------------------------------
    def dead(self) -> list[int]:
        """The ranks that have died (no system call while none has)."""
        return self.ranks.dead() if self.ranks is not None else []

    def crashed(self, dead: list[int], what: str) -> WorkerCrashed:
        assert self.ranks is not None
        return WorkerCrashed(f"rank {', '.join(map(str, dead))} died during {what}: "
                             f"{self.ranks.crash_report(dead)}")

    def timed_out(self, silent: list[int], timeout: float | None, what: str,
                  replies: Replies) -> WorkerTimeout:
        """The WorkerTimeout of the silent ranks, with their stacks, and with the
        exceptions of the ranks that raised meanwhile (errors.timeout_error)."""
        assert self.ranks is not None
        raised = {}
        for rank, (header, body) in sorted(replies.items()):
            if header.get(Field.STATUS) == Status.RAISED:
                raised[rank] = (ErrorRecord.parse(header.get(Field.ERROR)),
                                (body[0] if body else b"") or None)
        owing = sorted(r for r in silent if r in self.owing)
        interrupted = (self.owing[owing[0]] + 1, owing) if owing else None
        return timeout_error(f"no answer from rank {', '.join(map(str, silent))} within "
                             f"{timeout:g} s during {what}", raised, interrupted,
                             self.ranks.stacks(silent))

    # -- end -----------------------------------------------------------------------------
    def close(self, graceful: bool) -> None:
        """End every process and remove every file; safe to call in any state, twice."""
        if os.getpid() != self.owner_pid:
            return
        if self.ranks is not None:
            # Exits are expected from here on: no death notices.
            self.ranks.watch.close()
            grace = 0.0
            procs = self.ranks.procs
            if graceful and procs and all(p.alive() for p in procs) and self.bus is not None:
                with contextlib.suppress(zmq.ZMQError):
                    self.bus.publish({Field.KIND: Kind.SHUTDOWN, Field.SEQ: self.seq + 1})
                grace = self.shutdown_grace
            self.ranks.end(grace)
        if self.bus is not None:
            self.bus.close()
            self.bus = None
        if self.ipc_dir is not None:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)
            self.ipc_dir = None
        self.inputs.close()
        self.results.close()
        shm.remove_prefix(self.shm_dir, self.shm_prefix)
