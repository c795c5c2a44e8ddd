"""A rank's shared memory, and the command inbox that lets it come back mid-call.

A rank owns one pool (rank 0's results, :class:`~reactor_dist.shm.ledger.Ledger`) and maps
the runner's input segments (:class:`~reactor_dist.shm.ledger.Mapped`).  Memory comes back
to it without waiting for the next call::

    runner                                   rank 0 (in the middle of a stream)
      caller dropped items  -- release -->   its segments idle again, reused at once
      an input does not fit -- reclaim -->   every idle segment retired
                            <-- reclaimed -- (RETIRED: the runner unmaps them)
                            <-- starved ---  a result does not fit, even with its own
      retires its idle inputs,               idle segments retired; waits for:
      passes on releases    -- release -->   (the same ROUND) one more try, then the
                                             allocation error as before
      (nothing for IDLE_RETURN s) <-- trimmed -- every idle segment retired

A rank reads its commands only between calls, except here: :class:`Inbox` reads the
release and reclaim commands whenever the rank looks (after each yielded item, while
starved) and keeps every other command, in order, for the rank's loop.  It also reads
DROP as it comes: a restart's calls that already failed in the runner are skipped.
"""

from __future__ import annotations

import collections
import functools
import logging
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import zmq

from ..shm import segments
from ..shm.ledger import IDLE_RETURN, Ledger, Mapped
from ..wire import framing
from ..wire.protocol import Bootstrap, Field, Kind, result_tag, segments_of, snapshot_tag
from .host_pinning import HostPinning, cuda_runtime_of
from .staging import InputStaging, ResultStaging, stage_cpu

log = logging.getLogger("reactor_dist")
# Who holds a segment of rank 0's result ledger.
CALLER, WORKER = "caller", "worker"
POLLIN = int(zmq.POLLIN)
Message = tuple[dict[str, Any], list]


class Inbox:
    """The rank's commands in the order sent; the read-ahead ones (``Kind.READ_AHEAD``:
    shared memory back, DROP, ANSWERED) are applied as read, also in the middle of a
    call; the loop only wakes for them."""

    def __init__(self, channel: framing.Channel, sub: zmq.Socket,
                 on_memory: Callable[[dict[str, Any]], None]) -> None:
        self.channel, self.sub, self.on_memory = channel, sub, on_memory
        self.handle = sub.underlying  # for framing's compiled half (Channel.command)
        # ZeroMQ's EVENTS as a plain int (pyzmq's flag enums cost microseconds a test).
        self.events = functools.partial(super(zmq.Socket, sub).get, zmq.EVENTS)
        self.backlog: collections.deque[Message] = collections.deque()
        self.rejected = 0
        self.stopping = False  # a SHUTDOWN waits in the backlog: nobody will answer us
        self.dropped = 0  # every CALL up to this SEQ is skipped (Kind.DROP: a restart)
        self.answered = 0  # every rank answered the calls up to this SEQ (Kind.ANSWERED)

    def next(self, timeout_ms: int = -1) -> Message | None:
        """The next command for the rank's loop; a read-ahead one comes already applied
        (the loop only wakes for it); None when ``timeout_ms`` passed first."""
        if self.backlog:
            return self.backlog.popleft()
        while True:
            if timeout_ms >= 0 and not self.sub.poll(timeout_ms):
                return None
            message = self._read()
            if message is not None:
                return message

    def drain(self) -> None:
        """Apply the read-ahead commands that have arrived; keep the others for later.
        (ZeroMQ's EVENTS says whether a message is there: cheaper than a poll, which
        builds a Poller each time; this runs before every call.)"""
        while self.events() & POLLIN:
            message = self._read()
            if message is not None and message[0][Field.KIND] not in Kind.READ_AHEAD:
                self.backlog.append(message)
                if message[0][Field.KIND] == Kind.SHUTDOWN:
                    self.stopping = True

    def wait_for(self, done: Callable[[], bool]) -> None:
        """Read commands until ``done()`` (checked after each read-ahead one) or a
        SHUTDOWN arrives.  No deadline of its own: the runner answers whenever it reads
        its socket, and if it dies, the death watch ends this process."""
        while not done() and not self.stopping:
            message = self._read()
            if message is not None and message[0][Field.KIND] not in Kind.READ_AHEAD:
                self.backlog.append(message)
                self.stopping = self.stopping or message[0][Field.KIND] == Kind.SHUTDOWN

    def _read(self) -> Message | None:
        try:
            header, body = self.channel.command(self.sub, self.handle)
        except framing.ProtocolError as exc:
            self.rejected += 1
            if self.rejected <= 3:  # say it, but never flood the log
                log.warning("reactor-dist: rejected a message: %s", exc)
            return None
        kind = header[Field.KIND]
        if kind == Kind.DROP:
            self.dropped = max(self.dropped, header[Field.SEQ])
        elif kind == Kind.ANSWERED:  # held calls may go
            self.answered = max(self.answered, header[Field.SEQ])
        elif kind == Kind.RELEASE or kind == Kind.RECLAIM:
            self.on_memory(header)
        return header, body

    def over(self, seq: int) -> bool:
        """Whether call ``seq`` is over on every rank: all answered it, or a restart
        dropped it."""
        return seq <= self.answered or seq <= self.dropped

    def skips(self, seq: int) -> bool:
        """Whether the CALL ``seq`` failed in the runner already (a restart dropped it):
        the commands that have arrived are read first, so a DROP right behind counts."""
        self.drain()
        return seq <= self.dropped


class RankMemory:
    """Rank 0's result pool, every rank's snapshot pool (sessions: the caller holds a
    snapshot's segments until a newer one is complete, and past this rank's death) and
    every rank's mappings of the runner's inputs."""

    def __init__(self, boot: Bootstrap, rank: int,
                 send: Callable[[dict[str, Any]], None]) -> None:
        self.boot, self.send = boot, send
        self._device = "cpu"  # the rank's, once chosen: a CUDA rank page-locks its results
        self.pinning = HostPinning(cuda_runtime_of(lambda: self._device), boot.pinned_limit)
        self.results = Ledger(boot.shm_dir, boot.shm_prefix, result_tag(rank),
                              keep_free=boot.keep_free, reclaim=self.starve,
                              before_close=self.pinning.unpin, warm=self.pinning.is_pinned)
        # Rank 0's device tensors straight into registered result segments; every rank's
        # inputs to its GPU from registered mappings (staging.py).
        cpu_too = stage_cpu()
        self.result_staging = ResultStaging(self.staged_buffer, cpu_too)
        self.input_staging = InputStaging(boot.shm_dir, lambda: self.inputs.views,
                                          self.pinning, lambda: self._device, cpu_too)
        self.device = "cpu"  # and staging, with it
        self.snapshot_tag = snapshot_tag(rank)
        self.snapshots = Ledger(boot.shm_dir, boot.shm_prefix, self.snapshot_tag,
                                keep_free=1)
        prefix = boot.shm_prefix + "."
        self.inputs = Mapped(lambda name: segments.PrivateView(boot.shm_dir, name),
                             lambda name: "/" not in name and name.startswith(prefix),
                             unmapped=self.input_staging.unmapped)
        self.unchecked: set[str] = set()  # released input views not yet checked for writes
        self.inbox: Inbox | None = None  # set once connected
        self.call_seq = 0  # the call running now (for STARVED)
        self.rounds = 0  # STARVED rounds asked; ``answered`` the last one answered
        self.answered = 0

    # -- commands --------------------------------------------------------------------
    def apply(self, header: dict[str, Any]) -> None:
        """The RELEASED (ours, let go by the caller) and RETIRED (the runner's inputs,
        unlinked) fields of a command."""
        if Field.RELEASED not in header and Field.RETIRED not in header:
            return  # the common command: nothing to apply
        mine = f"{self.boot.shm_prefix}.{self.snapshot_tag}"
        for name in header.get(Field.RELEASED) or ():
            if isinstance(name, str):
                (self.snapshots if name.startswith(mine) else self.results).release(
                    name, CALLER)
        retired = header.get(Field.RETIRED)
        if retired:
            self.inputs.unmap(retired)

    def skipped(self, header: dict[str, Any]) -> None:
        """A CALL that a restart dropped is never run: what it names goes back as if it
        had been (its ledger fields applied, its input segments released)."""
        self.apply(header)
        self.inputs.release(segments_of(header.get(Field.DESCRIPTORS)))

    def tell(self, message: dict[str, Any], released: bool = False) -> None:
        """The ledger fields of an outgoing message: rank 0's segments it unlinked
        (RETIRED) and, with ``released``, the runner's inputs let go (RELEASED)."""
        if released:
            names = self.inputs.take_released()
            if names:
                message[Field.RELEASED] = names
                self.unchecked.update(names)
        retired = self.results.take_retired()
        snapshots = self.snapshots.take_retired()
        if retired or snapshots:
            message[Field.RETIRED] = retired + snapshots

    def on_memory(self, header: dict[str, Any]) -> None:
        """A RELEASE or RECLAIM command, whenever it is read."""
        self.apply(header)
        round_ = header.get(Field.ROUND)
        if header[Field.KIND] == Kind.RECLAIM:
            self.send({Field.KIND: Kind.RECLAIMED, Field.SEQ: 0, Field.ROUND: round_,
                       Field.RETIRED: self.results.retire_idle()})
        elif isinstance(round_, int) and round_ > self.answered:
            self.answered = round_  # the runner's answer to our STARVED

    def starve(self, nbytes: int) -> None:
        """Our own idle segments are gone and ``nbytes`` still do not fit: take the
        releases already sent, else ask the runner (STARVED) and wait for its answer."""
        assert self.inbox is not None
        self.inbox.drain()
        if self.inbox.stopping or self.results.fits(nbytes):
            return
        self.rounds += 1
        self.send({Field.KIND: Kind.STARVED, Field.SEQ: self.call_seq, Field.ROUND: self.rounds,
                   Field.NBYTES: nbytes, Field.RETIRED: self.results.take_retired()})
        self.inbox.wait_for(lambda: self.answered >= self.rounds)

    def trim(self) -> None:
        """Nobody called for IDLE_RETURN seconds: every idle segment goes back, but the
        registered result segments that a steady stream of calls reuses (their
        registration cost milliseconds; ``pinned_limit`` bounds them)."""
        retired = self.results.retire_idle(keep_warm=True) + self.snapshots.retire_idle()
        if retired:
            self.send({Field.KIND: Kind.TRIMMED, Field.SEQ: 0, Field.RETIRED: retired})

    def idle_wait_ms(self) -> int:
        """How long the rank's loop waits for a command before trimming (-1: for ever)."""
        idle = self.results.has_idle(keep_warm=True) or self.snapshots.has_idle()
        return int(IDLE_RETURN * 1000) if idle else -1

    # -- inputs and results ----------------------------------------------------------
    def check_written_views(self) -> None:
        """Drop mappings this rank wrote to; runs after the reply, off the caller's clock."""
        while self.unchecked:
            name = self.unchecked.pop()
            view = self.inputs.views.get(name)
            if view is not None and view.written():
                self.inputs.unmap([name])

    def snapshot_copy(self, name: str) -> np.ndarray:
        """A snapshot segment's bytes, read into this process's own memory: the restored
        state is the worker's to change, and the segment may be reused once a newer
        snapshot is complete."""
        if "/" in name or not name.startswith(self.boot.shm_prefix + "."):
            raise ValueError(f"a restore names a foreign segment {name!r}")
        return np.fromfile(f"{self.boot.shm_dir}/{name}", np.uint8)

    def input_base(self, name: str) -> np.ndarray:
        self.check_written_views()
        return self.inputs.base(name)

    def shared_empty(self, shape: Any, dtype: Any) -> np.ndarray:
        dtype = np.dtype(dtype)
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
        if not self.boot.shared_memory:  # the result travels in-band anyway
            return np.empty(shape, dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        seg = self.results.acquire(max(nbytes, 1), f"shared_empty({shape}, {dtype})",
                                   holders=[WORKER])
        self.pinning.pin(seg)  # a device-to-host copy into it at full speed
        base = np.frombuffer(seg.mm, np.uint8)
        weakref.finalize(base, self.results.release, seg.name, WORKER)
        return base[:nbytes].view(dtype).reshape(shape)

    @property
    def device(self) -> str:
        return self._device

    @device.setter
    def device(self, device: str) -> None:
        """The rank's device, once chosen; with it, whether rank 0's device tensors are
        staged (:attr:`staging`): a CUDA rank whose results travel through shared memory
        (or the test hook)."""
        self._device = device
        stages = self.boot.shared_memory and (device.startswith("cuda") or
                                              self.result_staging.cpu_too)
        self.staging: ResultStaging | None = self.result_staging if stages else None

    def staged_buffer(self, nbytes: int) -> np.ndarray:
        """A uint8 array over a result segment, registered where it can be: a device
        tensor's bytes go there (staging.py)."""
        return self.shared_empty((nbytes,), np.uint8)

    def to_device(self, x: Any, non_blocking: bool = True) -> Any:
        return self.input_staging.to_device(x, non_blocking)

    def close(self) -> None:
        self.input_staging.close()
        self.inputs.close()
        self.results.close()
        self.snapshots.close()
