"""One call on the wire: publish it, take its messages, turn its replies into Outcomes.

Data flow of one ``generate(x)`` (rank side: :mod:`reactor_dist.rank`; the order of
calls, their waits and the broken state: :mod:`reactor_dist.caller.call_queue`)::

    caller                                       rank r (x world_size)
    encode x (big buffers: 1 copy into an
      input segment); Bus.publish CALL ------->  verify, map input, generate()
    CallQueue dispatch <-----------------------  REPLY (status, error); rank 0 adds its
      by sequence number: the Call in flight     result, or first one ITEM per yielded
      (ITEMs decoded as they come), or none      item (big buffers in result segments)
      (a discarded answer: segments released)
    every rank replied: decode rank 0's result -> per-rank Outcomes -> outcome.judge

:class:`Call` is the record of one call in flight; :class:`CallPath` holds the bus,
the ranks and both ledgers (by composition: they belong to
:class:`reactor_dist.caller.supervisor.Supervisor`) and judges nothing.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from ..errors import (
    SharedMemoryExhausted,
    WorkerCrashed,
    WorkerTimeout,
    rebuild_exception,
    type_name,
)
from ..shm.ledger import IDLE_RETURN
from ..wire import transfer
from ..wire.protocol import ErrorRecord, Field, Kind, Method, Status, segments_of
from .bus import CommandBlocked
from .outcome import RETURNED, Outcome
from .reclaim import MemoryReturn

if TYPE_CHECKING:
    from .observers import CallRecord
    from .supervisor import Replies, Supervisor

SESSION = "session"  # the holder of a kept call's input segments (reactor_dist.caller.session)


class Call:
    """One call sent to the ranks: its replies so far, rank 0's items not yet taken, and
    when it is answered, its value or error.  Owned by the call queue's lock."""

    __slots__ = ("seq", "method", "timeout", "replies", "items", "left",
                 "generator", "started", "sent", "deadline", "watchers",
                 "done", "value", "error", "future", "itemized", "record", "measured",
                 "stream", "command", "received", "skip", "retried", "every_rank",
                 "logged", "returned", "compute", "waits")

    def __init__(self, seq: int, method: str, timeout: float | None, started: float = 0.0,
                 sent: float = 0.0) -> None:
        self.seq, self.method, self.timeout = seq, method, timeout
        self.started, self.sent = started, sent  # perf_counter: send() began, CALL published
        self.replies: Replies = {}
        self.returned = 0  # replies of status OK so far
        # Each rank's seconds in its worker method, and of those in collectives (its
        # REPLY's COMPUTE and COLLECTIVE_WAIT), by rank.
        self.compute: dict[int, float] = {}
        self.waits: dict[int, float] = {}
        self.items: collections.deque[Any] = collections.deque()
        self.left = False  # nobody takes its value or items any more (the glossary's "left")
        self.generator = False  # rank 0's generate() was a generator (known at the end)
        self.stream = False  # sent by stream()/astream(): its items are handed over as
        # they come (traces name its span reactor_dist.stream)
        # monotonic, once the ranks run it: the end of its wait for the next reply or
        # item (None: no limit, or not started yet).
        self.deadline: float | None = None
        self.watchers = 0  # callers that will come back and receive for it
        self.done = False
        self.value: Any = None
        self.error: BaseException | None = None
        self.future: Future | None = None  # submit()'s
        self.itemized = False  # rank 0's first item has come
        # For observers (observers.py): what they were told as it was sent (None: there
        # were none), and an answered call's times, compute and collective waits.
        self.record: CallRecord | None = None
        self.measured: tuple[tuple[float, float, float, float], tuple[float, ...],
                             tuple[float, ...] | None] | None = None
        # Sessions (reactor_dist.caller.session): what was sent, to send it again (a replay, a
        # retry); rank 0's items received so far, and how many of a retry's to skip
        # (handed over already); whether it was sent again once.
        self.command: Command | None = None
        self.received = self.skip = 0
        self.retried = False
        self.every_rank = False  # call_all's: every rank's result is the value
        self.logged = False  # a rank wrote log records during it (Field.LOGGED)

    def resent(self, seq: int, sent: float) -> None:
        """``retry_failed``: the same call, sent again as ``seq`` after a restart; the
        items it had brought are not handed over twice."""
        self.seq, self.sent = seq, sent
        self.replies, self.deadline, self.retried, self.logged = {}, None, True, False
        self.returned, self.compute, self.waits = 0, {}, {}
        self.skip, self.received = self.received, 0

    @property
    def what(self) -> str:
        """The call as errors and logs name it."""
        return f"{self.method}() (call {self.seq})"

    def settle(self, value: Any, error: BaseException | None) -> None:
        self.done, self.value, self.error = True, value, error

    def result(self) -> Any:
        """The value of an answered call, or raise its error."""
        if self.error is not None:
            raise self.error  # keeps its __cause__: a rank's exception behind a timeout
        return self.value

    def __repr__(self) -> str:
        return f"<Call {self.what} {'done' if self.done else 'in flight'}>"


class Command(NamedTuple):
    """A call as sent, to send it again (sessions): its input's buffers stay in their
    segments, held for it (``segments``), until it is no longer needed."""

    method: str
    descriptors: list | None
    body: list  # the pickle stream and inline buffers, copied (the caller may reuse its own)
    segments: list[str]
    timeout: float | None
    every_rank: bool = False  # call_all's: every rank sends its result


class Arguments(NamedTuple):
    """The value of a call of a worker method by name (``runner.call``): what the ranks
    call it with, and whether every rank's result comes back (``call_all``)."""

    args: tuple
    kwargs: dict[str, Any]
    every_rank: bool = False


class Undecodable(NamedTuple):
    """An item that did not unpickle in the caller (raised where it is taken)."""

    error: Exception


class Ends(Protocol):
    """A stream's iterator (threads' or tasks'), as :func:`hand_out` sees it."""

    def close(self) -> None: ...

    def end(self) -> Call | None: ...


def hand_out(stream: Ends, more: bool, item: Any, stop: type[Exception]) -> Any:
    """What a stream's next item is: an item; at the end the contract's error, a plain
    worker's one value, or ``stop`` after a generator's last item."""
    if more:
        if isinstance(item, Undecodable):  # it did not unpickle here: the step goes on
            stream.close()
            raise item.error
        return item
    ended = stream.end()
    assert ended is not None
    value = ended.result()  # raises the contract's error
    if ended.generator:
        raise stop
    return value


def any_raised(call: Call) -> bool:
    """A rank raised in ``call``: the ranks that did hold the next call until every rank
    answered this one (Kind.ANSWERED)."""
    return any(header.get(Field.STATUS) == Status.RAISED
               for header, _ in call.replies.values())


def rank_seconds(call: Call, world_size: int) -> tuple[tuple[float, ...],
                                                     tuple[float, ...] | None]:
    """Each rank's seconds inside its worker method (Field.COMPUTE of its REPLY), and of
    those its seconds waiting in torch.distributed collectives (Field.COLLECTIVE_WAIT;
    None when the ranks measured none: no group formed)."""
    compute, waits = call.compute, call.waits
    ranks = range(world_size)
    return (tuple([compute.get(rank, 0.0) for rank in ranks]),
            tuple([waits.get(rank, 0.0) for rank in ranks]) if 0 in waits else None)


# What an acknowledgement stands for among a call's replies (Call.replies): a REPLY of
# status OK with nothing else (its times are in Call.compute and Call.waits).  Shared:
# never changed.
ACKNOWLEDGED: tuple[dict[str, Any], list] = ({Field.KIND: Kind.REPLY, Field.STATUS: Status.OK},
                                             [])


class CallPath:
    """Sending calls and taking their messages, over the supervisor's bus, ranks and
    ledgers; from the call queue, ``wait_for`` lets a RECLAIM round receive mid-send and
    ``busy`` names the ranks still running an earlier call."""

    def __init__(self, supervisor: Supervisor,
                 wait_for: Callable[[Callable[[], bool], float | None], None],
                 busy: Callable[[], list[int]]) -> None:
        assert supervisor.bus is not None and supervisor.ranks is not None
        self.supervisor = supervisor
        self.world_size = supervisor.world_size
        self.bus, self.ranks = supervisor.bus, supervisor.ranks
        self.inputs, self.results = supervisor.inputs, supervisor.results
        self.inline_limit = supervisor.inline_limit
        self.busy = busy  # the ranks still running an earlier call
        self.seq = 0
        # A Kind.ANSWERED a full pipe refused (the call queue's and the replay's alike):
        # the ranks that raised in that call hold the next one until it arrives.
        self.answered_due = 0
        self.last_sent = 0.0  # perf_counter when the last call was sent (releaser.py)
        self.memory = MemoryReturn(self.bus, self.inputs, self.results, self.world_size,
                                   lambda: self.seq, wait_for)
        self.inputs.reclaim = self.memory.reclaim

    def send(self, method: str, value: Any, timeout: float | None,
             behind: bool = False, keep: bool = False) -> Call:
        """Publish one call; raises (having sent nothing) when it can't: TypeError (the
        input does not pickle), SharedMemoryExhausted, WorkerCrashed (a rank died
        while idle), WorkerTimeout (no rank took the command).  ``keep`` (sessions):
        the call keeps its :class:`Command` and its input's segments (held by SESSION),
        and rank 0 digests its result."""
        started = time.perf_counter()
        if self.ranks.watch.fired:
            dead = self.ranks.dead()
            if dead:
                raise self.supervisor.crashed(dead, "an idle moment between calls",
                                              logged=False)  # CallQueue.broken logs it
        header: dict[str, Any] = {Field.KIND: Kind.CALL, Field.METHOD: method}
        body: list = [b""]
        segments: list[str] = []
        if started - self.last_sent > IDLE_RETURN and self.inputs.idle:
            self.inputs.retire_idle()  # a cache, never a hoard: they ride as RETIRED
        self.last_sent = started
        every_rank = False
        if Method.takes_input(method):
            what = "the input of generate()"
            if isinstance(value, Arguments):  # a worker method by name: its arguments
                every_rank, value = value.every_rank, (value.args, value.kwargs)
                what = f"the arguments of {method}()"
            self.inputs.new_call()
            self.memory.reclaim_timeout = timeout
            try:
                descriptors, body, segments = transfer.encode(
                    value, self.inputs, what, holders=range(self.world_size),
                    inline_limit=self.inline_limit)
            except (SharedMemoryExhausted, WorkerCrashed, WorkerTimeout):
                raise  # (a rank that died during a reclaim round)
            except Exception as exc:
                raise TypeError(
                    f"{what} cannot be pickled ({type(exc).__name__}: {exc}); "
                    f"inputs must pickle: plain data, numpy arrays, tensors, module-level "
                    f"classes"
                ) from exc
            if descriptors:
                header[Field.DESCRIPTORS] = descriptors
            if every_rank:
                header[Field.ALL] = True
            if keep:
                header[Field.DIGEST] = True
        command = None
        if keep:
            command = Command(method, header.get(Field.DESCRIPTORS), [bytes(f) for f in body],
                              segments, timeout, every_rank)
        seq = self.send_numbered(header, body, timeout, behind, method)
        call = Call(seq, method, timeout, started, time.perf_counter())
        call.every_rank = every_rank
        if command is not None:
            for name in segments:
                self.inputs.hold(name, SESSION)
            call.command = command
        return call

    def send_again(self, command: Command, behind: bool) -> int:
        """Sessions: a kept call's command once more, as a new call (its sequence number):
        its input segments, still held for it, are held by every rank again."""
        header: dict[str, Any] = {Field.KIND: Kind.CALL, Field.METHOD: command.method}
        if command.descriptors:
            header[Field.DESCRIPTORS] = command.descriptors
        if Method.takes_input(command.method):
            header[Field.DIGEST] = True
        if command.every_rank:
            header[Field.ALL] = True
        seq = self.send_numbered(header, list(command.body), command.timeout, behind,
                           command.method)
        for name in command.segments:  # sent: every rank releases them after it
            for rank in range(self.world_size):
                self.inputs.hold(name, rank)
        return seq

    def send_numbered(self, header: dict[str, Any], body: list, timeout: float | None,
                behind: bool, method: str) -> int:
        """Number and publish one CALL, with what the caller has to give back; its
        sequence number."""
        if behind:  # other calls in flight: a failure may drop this one before it starts
            header[Field.BEHIND] = True
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
            raise self.supervisor.not_taken(timeout, f"{method}()'s command",
                                           self.busy(), seq, method) from None
        return seq

    def receive(self, wait_ms: int) -> tuple[dict, list] | None:
        """The next message (None when ``wait_ms`` passed first), its ledger fields
        applied; first passes on what the caller has to give back."""
        self.memory.flush()
        message = self.bus.receive(wait_ms)
        if message is not None:
            self.arrived(message[0])
        return message

    def arrived(self, header: dict[str, Any]) -> None:
        """Apply the ledger fields that any message may carry; answer a STARVED."""
        if Field.RELEASED in header or Field.RETIRED in header:
            rank = header[Field.RANK]
            for name in header.get(Field.RELEASED) or ():
                if isinstance(name, str):
                    self.inputs.release(name, rank)
            self.results.unmap(header.get(Field.RETIRED) or ())
        kind = header[Field.KIND]
        if kind == Kind.STARVED:
            self.memory.feed(header)
        elif kind == Kind.RECLAIMED:
            self.memory.reclaimed_by(header)

    def take_item(self, call: Call, header: dict[str, Any], body: list) -> None:
        """Rank 0's next item of ``call``: decoded now, or handed back unread."""
        call.received += 1
        if call.left or header.get(Field.INDEX, 0) < call.skip:  # a retry's: handed over
            self.discard(header)
        else:
            call.items.append(self.decode_item(header, body))

    def owe_answered(self, call: Call) -> None:
        """Every rank answered ``call``: if any raised, they hold the next call until
        told (Kind.ANSWERED), now or, if a pipe is full, at the next receive."""
        if any_raised(call):
            self.answered_due = call.seq
            self.tell_answered()

    def tell_answered(self) -> None:
        """The ANSWERED still owed, if any (a full pipe keeps it owed: a rank that is
        behind reads it in turn)."""
        if self.answered_due and self.bus.publish({Field.KIND: Kind.ANSWERED,
                                                   Field.SEQ: self.answered_due}):
            self.answered_due = 0

    def discard(self, header: dict[str, Any]) -> None:
        """A message nobody will read (a left call's, a failed call's): its result
        segments go back to rank 0 unmapped."""
        self.results.release(segments_of(header.get(Field.DESCRIPTORS)))

    def decode_item(self, header: dict[str, Any], body: list) -> Any:
        try:
            return transfer.decode(header.get(Field.DESCRIPTORS), body, self.results.base)
        except Exception as exc:
            if hasattr(exc, "add_note"):  # Python 3.11+
                exc.add_note(f"(while unpickling item {header.get(Field.INDEX)} of rank 0 in "
                             f"the caller; the runner stays healthy)")
            return Undecodable(exc)

    def every_result(self, call: Call) -> Outcome:
        """``call_all``'s value: every rank's result, in rank order (each decoded here;
        one that does not unpickle makes the call undeliverable, as rank 0's would)."""
        values, error = [], None
        for rank in range(self.world_size):
            header, body = call.replies[rank]
            if error is not None:
                self.discard(header)
                continue
            try:
                values.append(transfer.decode(header.get(Field.DESCRIPTORS), body,
                                              self.results.base))
            except Exception as exc:
                error = exc
                values = []
        if error is not None:
            return Outcome(Status.UNDELIVERABLE, None, error, type_name(error))
        return Outcome(Status.OK, values)

    def collectives(self, call: Call) -> Any:
        """What the ranks' collective rings say of ``call`` (judge asks when a rank did
        not return): a collective_ring.Report; None where none recorded one."""
        return self.supervisor.collectives(call.seq)

    def returned(self, call: Call) -> Outcome:
        """Every rank returned ``call``: rank 0's Outcome, its result decoded (every rank's,
        for ``call_all``) when somebody takes it, else released unread."""
        replies = call.replies
        call.generator = generator = Field.ITEMS in replies[0][0]
        if call.method in Method.BUILT_IN and call.method != Method.GENERATE:
            return RETURNED
        if call.left:
            for header, _ in replies.values():
                self.discard(header)
            return RETURNED
        if call.every_rank:
            return self.every_result(call)
        try:
            if generator:  # its items are the value
                value: Any = list(call.items)
                undecodable = [i for i in value if isinstance(i, Undecodable)]
                if undecodable:
                    raise undecodable[0].error
            else:
                header, body = replies[0]
                value = transfer.decode(header.get(Field.DESCRIPTORS), body, self.results.base)
            return Outcome(Status.OK, value)
        except Exception as exc:
            return Outcome(Status.UNDELIVERABLE, None, exc, type_name(exc))

    def outcomes(self, call: Call) -> list[Outcome]:
        """Every rank's Outcome; rank 0's result (every rank's, for ``call_all``, as rank
        0's value) is decoded only when every rank returned and somebody takes it (else
        it is released unread)."""
        replies = call.replies
        call.generator = Field.ITEMS in replies[0][0]
        if call.returned == self.world_size:
            return [self.returned(call)] + [RETURNED] * (self.world_size - 1)
        outcomes = []
        for rank in range(self.world_size):
            header, body = replies[rank]
            status = header.get(Field.STATUS)
            if status == Status.OK:
                self.discard(header)
                outcomes.append(RETURNED)
                continue
            record = ErrorRecord.parse(header.get(Field.ERROR))
            error = rebuild_exception(record, (body[0] if body else b"") or None, rank)
            if status != Status.UNDELIVERABLE:
                status = Status.RAISED
            # Its record, should the judge find a desync: it just answered, so it runs.
            failure, = self.ranks.failures([rank], self.supervisor.devices, seq=call.seq,
                                           method=call.method, errors={rank: error},
                                           answered=True)
            broken = header.get(Field.BROKEN) is True
            if broken:  # alive, but the next restart replaces it (restart.restart)
                self.supervisor.lost.add(rank)
            outcomes.append(Outcome(status, None, error, record.type, failure, broken))
        return outcomes
