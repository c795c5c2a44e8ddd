"""The runner's side of one call: encode, publish, collect, decode.

Data flow of one ``generate(x)`` (rank side: :mod:`reactor_dist.rank`)::

    caller thread                                rank r (x world_size)
    encode x (big buffers: 1 copy into an
      input segment); Bus.publish CALL ------->  verify, map input, generate()
    Bus.receive <------------------------------  REPLY (status, error); rank 0 adds its
      ITEMs of this call: decoded, kept          result, or first one ITEM per yielded
      an older call's: segments released         item (big buffers in result segments)
      DEATH (death watch): WorkerCrashed
      deadline: WorkerTimeout + the stacks
    decode rank 0's result -> per-rank Outcomes -> runner: outcome.judge

Segments: the runner's input ledger and rank 0's result ledger
(:mod:`reactor_dist.ledger`); releases and retirements ride on the next message
the other way (RELEASED / RETIRED).
"""

from __future__ import annotations

import collections
import contextlib
import os
import pickle
import shutil
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import zmq

from . import shm, transfer
from .bus import Bus, private_dir, reclaim_dead_ipc_dirs
from .errors import WorkerCrashed, WorkerTimeout, rebuild_exception, type_name
from .ledger import Ledger, Mapped
from .outcome import RETURNED, Outcome
from .processes import Ranks, free_port
from .protocol import (
    SECRET_SIZE,
    Bootstrap,
    ErrorRecord,
    Field,
    Kind,
    Method,
    Status,
    WorkerRef,
    segments_of,
)

PING_EVERY = 0.02  # handshake: until every rank answered (PUB/SUB's slow joiner)
Replies = dict[int, tuple[dict, list]]
ENDED = object()  # next_item(): every rank answered, no item is left


class PendingCall:
    """One call the ranks are running: its replies so far and rank 0's items not yet
    taken (a stream's, or a generate() of a generator worker's)."""

    __slots__ = ("seq", "method", "timeout", "what", "replies", "items", "abandoned",
                 "generator")

    def __init__(self, seq: int, method: str, timeout: float | None) -> None:
        self.seq, self.method, self.timeout = seq, method, timeout
        self.what = f"{method}() (call {seq})"
        self.replies: Replies = {}
        self.items: collections.deque[Any] = collections.deque()
        self.abandoned = False  # left early: its items go back unread
        self.generator = False  # rank 0's generate() was a generator (known at the end)

    def abandon(self) -> None:
        """Nobody takes the items any more: the ones kept go, later ones come back unread."""
        self.abandoned = True
        self.items.clear()


class Undecodable(NamedTuple):
    """An item that did not unpickle in the caller (raised where it is taken)."""

    error: Exception


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
        self.ranks = Ranks(self.world_size, self.bus.tell_death)
        # For models that form their own group (init_process_group=False): one port for
        # all ranks. With our group, rank 0's store binds port 0 and Kind.INIT carries its port.
        master_port = free_port()
        for rank in range(self.world_size):
            self._spawn(rank, master_port)
        bus = self.bus
        pongs = self.handshake(Kind.PONG, deadline - time.monotonic(), timeout,
                               ping=lambda: bus.publish({Field.KIND: Kind.PING, Field.SEQ: 0}))
        for rank, (header, _) in pongs.items():
            self.ranks.found_launcher(rank, header.get(Field.PID))
        store_port = pongs[0][0].get(Field.PORT) or 0
        bus.publish({Field.KIND: Kind.INIT, Field.SEQ: 0, Field.PORT: store_port})
        ready = self.handshake(Kind.READY, deadline - time.monotonic(), timeout,
                               first_error=True)
        for rank, (header, body) in ready.items():
            if header.get(Field.STATUS) == Status.RAISED:
                raise rebuild_exception(ErrorRecord.parse(header.get(Field.ERROR)),
                                        body[0] if body else None, rank)

    def _spawn(self, rank: int, master_port: int) -> None:
        assert self.bus is not None and self.ranks is not None
        boot = Bootstrap(
            rank=rank, world_size=self.world_size, secret=self.secret,
            cmd_addr=self.bus.cmd_addr, reply_addr=self.bus.reply_addr,
            runner_pid=os.getpid(), shm_dir=self.shm_dir, shm_prefix=self.shm_prefix,
            worker=self._worker, load_kwargs=self._load_kwargs,
            init_process_group=self._init_process_group, device=self._device,
            start_timeout=self._start_timeout, keep_free=self._keep_free,
            sys_path=list(sys.path))
        self.ranks.spawn(rank, boot.to_bytes(), master_port=master_port, env=self._env,
                         gpus=self._gpus, launch_prefix=self._launch_prefix)

    # -- one call ------------------------------------------------------------------------
    def call(self, method: str, value: Any, timeout: float | None) -> list[Outcome]:
        """Run ``method(value)`` on every rank: one Outcome per rank, in rank order (a
        generator worker's items, decoded as they came, are rank 0's value).

        Raises before sending (TypeError: the input does not pickle;
        SharedSlotAllocationFailed), or WorkerCrashed / WorkerTimeout."""
        pending = self.send(method, value, timeout)
        self.collect(pending)
        return self.outcomes(pending)

    def send(self, method: str, value: Any, timeout: float | None) -> PendingCall:
        """Publish one call; raises (having sent nothing) when it can't."""
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
        return PendingCall(seq, method, timeout)

    def next_item(self, pending: PendingCall) -> Any:
        """The next of rank 0's items (``ENDED`` once every rank answered); an item that
        cannot be unpickled here is raised."""
        while not pending.items:
            if len(pending.replies) == self.world_size:
                return ENDED
            self.collect(pending, until_item=True)
        item = pending.items.popleft()
        if isinstance(item, Undecodable):
            raise item.error
        return item

    def outcomes(self, pending: PendingCall) -> list[Outcome]:
        """Every rank's Outcome; rank 0's result is decoded only when every rank returned
        (else it is released unread: the call fails whatever it holds)."""
        replies = pending.replies
        if [h.get(Field.STATUS) for h, _ in replies.values()].count(Status.OK) == self.world_size:
            first = RETURNED
            if pending.method == Method.GENERATE:
                header, body = replies[0]
                try:
                    pending.generator = Field.ITEMS in header
                    if pending.generator:  # its items are the value
                        value: Any = list(pending.items)
                        undecodable = [i for i in value if isinstance(i, Undecodable)]
                        if undecodable:
                            raise undecodable[0].error
                    else:
                        value = transfer.decode(header.get(Field.DESCRIPTORS), body,
                                                self.results.base)
                    first = Outcome(Status.OK, value)
                except Exception as exc:
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

    def collect(self, pending: PendingCall, until_item: bool = False) -> None:
        """Wait for every rank's REPLY to ``pending`` (or, ``until_item``, for rank 0's next
        ITEM); WorkerCrashed on a death notice, WorkerTimeout when ``pending.timeout``
        passes without a reply or an item."""
        timeout = pending.timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(pending.replies) < self.world_size:
            header, body = self.wait(deadline, pending.what, pending.replies, timeout)
            if header is not None and self.take(pending, header, body):
                if until_item:
                    return
                if timeout is not None:  # the timeout bounds the wait for each item
                    deadline = time.monotonic() + timeout

    def take(self, pending: PendingCall, header: dict[str, Any], body: list) -> bool:
        """Apply one message to ``pending``; True when it brought one of its items.  Items
        are decoded as they come, unless the call was abandoned (then their segments go
        back unread); a death notice raises WorkerCrashed."""
        kind, rank = header[Field.KIND], header[Field.RANK]
        if kind == Kind.REPLY and header[Field.SEQ] == pending.seq:
            if rank not in pending.replies:
                pending.replies[rank] = (header, body)
        elif kind == Kind.ITEM and header[Field.SEQ] == pending.seq and rank == 0:
            if pending.abandoned:
                self.results.release(segments_of(header.get(Field.DESCRIPTORS)))
            else:
                pending.items.append(self.decode_item(header, body))
            return True
        elif kind == Kind.DEATH:
            assert self.ranks is not None
            raise self.crashed(self.ranks.dead() or [rank], pending.what)
        elif kind in (Kind.REPLY, Kind.ITEM):
            # Of an older (interrupted) call: hand its segments back.
            self.results.release(segments_of(header.get(Field.DESCRIPTORS)))
        return False

    def decode_item(self, header: dict[str, Any], body: list) -> Any:
        try:
            return transfer.decode(header.get(Field.DESCRIPTORS), body, self.results.base)
        except Exception as exc:
            if hasattr(exc, "add_note"):  # Python 3.11+
                exc.add_note(f"(while unpickling item {header.get(Field.INDEX)} of rank 0 in "
                             f"the caller; the runner stays healthy)")
            return Undecodable(exc)

    def wait(self, deadline: float | None, what: str, replies: Replies,
             timeout: float | None) -> tuple[Any, Any]:
        """The next message for the runner, ``(None, None)`` when none came in time;
        WorkerTimeout once ``deadline`` passed.  Applies the ledger fields every message
        carries."""
        assert self.bus is not None
        if deadline is None:
            message = self.bus.receive(-1)
        else:
            message = self.bus.receive(int(max(0.0, deadline - time.monotonic()) * 1000) + 1)
        if message is None:
            if deadline is not None and time.monotonic() >= deadline:
                silent = [r for r in range(self.world_size) if r not in replies]
                raise self.timed_out(silent, timeout, what, replies)
            return None, None
        return self.arrived(message)

    def arrived(self, message: tuple[dict, list]) -> tuple[dict, list]:
        """Apply the ledger fields that any message may carry."""
        header = message[0]
        if Field.RELEASED in header or Field.RETIRED in header:
            self._apply_ledger_fields(header)
        return message

    def handshake(self, kind: str, timeout: float, stated_timeout: float,
                  ping: Callable[[], None] | None = None, first_error: bool = False) -> Replies:
        """Start-up: wait for ``kind`` from every rank, ``ping`` repeated every PING_EVERY;
        with ``first_error`` a RAISED answer ends the wait at once (a failed load() makes
        the rest pointless)."""
        assert self.ranks is not None and self.bus is not None
        replies: Replies = {}
        deadline = time.monotonic() + timeout
        while len(replies) < self.world_size:
            if ping is not None:
                ping()
            left = deadline - time.monotonic()
            if left <= 0:
                silent = [r for r in range(self.world_size) if r not in replies]
                raise self.timed_out(silent, stated_timeout, "start()", replies)
            wait = min(left, PING_EVERY) if ping is not None else left
            message = self.bus.receive(int(wait * 1000) + 1)
            if message is None:
                continue
            header, rank = message[0], message[0][Field.RANK]
            if header[Field.KIND] == kind and rank not in replies:
                replies[rank] = message
                if first_error and header.get(Field.STATUS) == Status.RAISED:
                    return {rank: message}
            elif header[Field.KIND] == Kind.DEATH:
                raise self.crashed(self.ranks.dead() or [rank], "start()")
        return replies

    def finish(self, pending: PendingCall) -> list[Outcome]:
        """Wait for the end of an abandoned call, its remaining items handed back unread
        (the next call must not start while the ranks still run this step)."""
        pending.abandon()
        self.collect(pending)
        return self.outcomes(pending)

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
        assert self.ranks is not None
        raised = [f"rank {r} raised {ErrorRecord.parse(h.get(Field.ERROR)).type}"
                  for r, (h, _) in sorted(replies.items()) if h.get(Field.STATUS) == Status.RAISED]
        note = f" ({'; '.join(raised)}: the silent ranks may wait for it in a collective)" \
            if raised else ""
        return WorkerTimeout(
            f"no answer from rank {', '.join(map(str, silent))} within {timeout:g} s "
            f"during {what}{note}; their stacks:\n{self.ranks.stacks(silent)}")

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
