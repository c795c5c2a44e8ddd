"""One call's path through the runner: publish, collect the answers, judge nothing.

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

The half of :class:`reactor_dist.transport.Transport` that runs once per call (the
other half starts and ends the ranks).  A call is a :class:`PendingCall`: the
replies so far and rank 0's items not yet taken.  :meth:`CallPath.collect` waits
for them in one blocking receive per message; :mod:`reactor_dist.aio` takes the
same messages without blocking, through :meth:`CallPath.take`.  Interrupted calls
(Ctrl-C, a cancelled task, a stream left early) are remembered, so that their late
answers are recognised as such and :meth:`CallPath.wait_idle` can wait for them.
"""

from __future__ import annotations

import collections
import time
from typing import TYPE_CHECKING, Any, NamedTuple

from . import shm, timeouts, transfer
from .bus import CommandBlocked
from .errors import WorkerCrashed, WorkerTimeout, rebuild_exception, type_name
from .ledger import IDLE_RETURN, Ledger, Mapped
from .outcome import RETURNED, Outcome
from .protocol import ErrorRecord, Field, Kind, Method, Status, segments_of
from .reclaim import MemoryReturn

if TYPE_CHECKING:
    from .bus import Bus
    from .processes import Ranks

Replies = dict[int, tuple[dict, list]]
ENDED = object()  # next_item(): every rank answered, no item is left


class PendingCall:
    """One call the ranks are running: its replies so far and rank 0's items not yet
    taken (a stream's, or a generate() of a generator worker's)."""

    __slots__ = ("seq", "method", "timeout", "what", "replies", "items", "abandoned",
                 "generator", "started", "sent")

    def __init__(self, seq: int, method: str, timeout: float | None, started: float = 0.0,
                 sent: float = 0.0) -> None:
        self.seq, self.method, self.timeout = seq, method, timeout
        self.started, self.sent = started, sent  # perf_counter: send() began, CALL published
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



class CallPath(MemoryReturn):
    """Sending calls and taking their answers (a part of Transport, which sets the
    attributes below)."""

    world_size: int
    seq: int
    bus: Bus | None
    ranks: Ranks | None
    inputs: Ledger
    results: Mapped
    owing: dict[int, int]
    interrupted: int
    last_sent: float = 0.0  # perf_counter when the last call was sent
    inline_limit: int = transfer.INLINE_LIMIT  # IN_BAND when a rank is on another node

    def crashed(self, dead: list[int], what: str) -> WorkerCrashed:
        raise NotImplementedError

    def timed_out(self, silent: list[int], timeout: float | None, what: str,
                  replies: Replies) -> WorkerTimeout:
        raise NotImplementedError

    def not_taken(self, timeout: float | None, what: str) -> WorkerTimeout:
        raise NotImplementedError

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
        started = time.perf_counter()
        assert self.ranks is not None and self.bus is not None
        if self.ranks.watch.fired:
            dead = self.ranks.dead()
            if dead:
                raise self.crashed(dead, "an idle moment between calls")
        header: dict[str, Any] = {Field.KIND: Kind.CALL, Field.METHOD: method}
        body: list = [b""]
        if started - self.last_sent > IDLE_RETURN and self.inputs.idle:
            self.inputs.retire_idle()  # a cache, never a hoard: they ride as RETIRED
        self.last_sent = started
        if method == Method.GENERATE:
            self.inputs.new_call()
            self.reclaim_timeout = timeout
            try:
                descriptors, body, _ = transfer.encode(
                    value, self.inputs, "the input of generate()", holders=range(self.world_size),
                    inline_limit=self.inline_limit)
            except (shm.SharedSlotAllocationFailed, WorkerCrashed, WorkerTimeout):
                raise  # (a rank that died during a reclaim round)
            except Exception as exc:
                raise TypeError(
                    f"the input of generate() cannot be pickled ({type(exc).__name__}: {exc}); "
                    f"inputs must pickle: plain data, numpy arrays, tensors, module-level "
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
        try:  # a rank's full pipe: wait for room as long as the call would wait
            self.bus.publish(header, body, None if timeout is None else
                             time.monotonic() + timeout)
        except CommandBlocked:
            raise self.not_taken(timeout, f"{method}()'s command") from None
        return PendingCall(seq, method, timeout, started, time.perf_counter())

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

    def compute(self, pending: PendingCall) -> tuple[float, ...]:
        """Each rank's seconds inside its worker method (Field.COMPUTE of its REPLY)."""
        replies = pending.replies
        return tuple([replies[rank][0].get(Field.COMPUTE, 0.0)
                      for rank in range(self.world_size)])

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
        try:
            while len(pending.replies) < self.world_size:
                header, body = self.wait(deadline, pending.what, pending.replies, timeout)
                if header is not None and self.take(pending, header, body):
                    if until_item:
                        return
                    if timeout is not None:  # the timeout bounds the wait for each item
                        deadline = time.monotonic() + timeout
        except (WorkerCrashed, WorkerTimeout):
            raise
        except BaseException:  # interrupted (Ctrl-C, a cancelled task): ranks still run it
            self.left_running(pending)
            raise
        if self.owing:
            self.owing.clear()  # every rank answered this call, so every earlier one

    def left_running(self, pending: PendingCall) -> None:
        """Nobody waits for ``pending`` any more, but the ranks that did not answer it
        still run it: their next answers are late ones (see wait_idle)."""
        self.interrupted = pending.seq
        for rank in range(self.world_size):
            if rank in pending.replies:
                self.owing.pop(rank, None)
            else:
                self.owing.setdefault(rank, pending.seq - 1)

    def wait_idle(self, timeout: float | None) -> bool:
        """Until every rank answered every interrupted call: True, or False at the
        deadline (nothing else changes).  WorkerCrashed when a rank dies meanwhile."""
        deadline = None if timeout is None else time.monotonic() + timeout
        idle = PendingCall(-1, "wait_idle", None)  # answers nothing: only late ones come
        while self.owing:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            header, body = self.wait(None if left is None else deadline, "wait_idle()",
                                     {}, None, quiet=True)
            if header is not None:
                self.take(idle, header, body)
        return True

    def take_late(self, header: dict[str, Any], body: list) -> None:
        """Apply a message while no call waits for it (late replies, death notices)."""
        self.take(PendingCall(-1, "late", None), header, body)

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
        elif kind in (Kind.REPLY, Kind.ITEM):  # of an older (interrupted) call
            self.results.release(segments_of(header.get(Field.DESCRIPTORS)))
            seq = header[Field.SEQ]
            if kind == Kind.REPLY and rank in self.owing and isinstance(seq, int):
                self.owing[rank] = max(self.owing[rank], seq)  # it finished that call
                if self.owing[rank] >= self.interrupted:
                    del self.owing[rank]
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
             timeout: float | None, quiet: bool = False) -> tuple[Any, Any]:
        """The next message for the runner, ``(None, None)`` when none came in time;
        WorkerTimeout once ``deadline`` passed (``quiet``: not even then).  Applies the
        ledger fields every message carries."""
        assert self.bus is not None
        self.flush()
        if deadline is None:
            message = self.bus.receive(-1)
        else:
            message = self.bus.receive(timeouts.wait_ms(deadline - time.monotonic()))
        if message is None:
            if not quiet and deadline is not None and time.monotonic() >= deadline:
                silent = [r for r in range(self.world_size) if r not in replies]
                raise self.timed_out(silent, timeout, what, replies)
            return None, None
        return self.arrived(message)

    def arrived(self, message: tuple[dict, list]) -> tuple[dict, list]:
        """Apply the ledger fields that any message may carry; answer a STARVED."""
        header = message[0]
        if Field.RELEASED in header or Field.RETIRED in header:
            self._apply_ledger_fields(header)
        if header[Field.KIND] == Kind.STARVED:
            self.feed(header)
        return message

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

