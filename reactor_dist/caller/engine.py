"""The engine: the caller's state machine, without I/O.

It decides everything about calls on the caller's side: the runner's :class:`State`,
the order of calls and the turns of the callers that make them, the calls in flight,
their deadlines, the verdict on each answered call (:func:`~reactor_dist.caller.outcome.judge`),
what a crash, a timeout or a desync fails, and the restart handshake.  It reads no
socket, sends nothing, takes no lock, starts no thread and never waits: the driver
(:class:`reactor_dist.caller.call_queue.CallQueue`, for threads and asyncio tasks alike)
does all of that and tells it what happened:

    driver                                   Engine
    encode + publish CALL 7  ----------->    sent(call 7)       in flight [7]
    a message arrives        ----------->    feed(REPLY 7, now) every rank answered 7:
                                                                judged, settled
    nothing arrives, time passes --------->  overdue(now)       -> call 7: its error is
                                                                made by the driver, then
    a crash, a timeout       ----------->    broken(error, at)  every call in flight fails
    carry_out()              <-----------    todo: take the ranks' output, log, tell the
                                             ranks ANSWERED, start the restart, wake the
                                             collector; settled: futures to settle;
                                             changed: waiters must look again

The states and the only moves between them (:data:`MOVES`; :meth:`Engine.move` is the
one place the state changes, and an illegal move is a bug that raises)::

    new --start()--> healthy --crash / timeout / desync--> unusable
     |                ^   |  \\                               |
     |                |   |   +--(max_restarts)--+            | restart()
     |                |   +------ restart() -----+-> restarting <-+
     |                +------------------------------------+   |
     |                                   a restart that failed: unusable
     +----------- shutdown() (or a failed start()) from any state ---------> closed

The ranks run calls strictly in the order sent.  A call's ``timeout`` bounds, from
when the ranks start it, its wait for each reply or item; a rank that raised in a call
starts the next one only once every rank answered it (Kind.ANSWERED), so that no
collective of one call pairs with another's.  A crash, a timeout or a desync breaks
the runner: that call and every call behind it fail with that type of error (their
messages name the call that broke it); a call whose every rank raised the same type
fails alone.  A call that is left (nobody takes its answer any more: Ctrl-C, a cancelled
task, a stream closed early) stays in flight until the ranks answer it; its answer is
discarded.

What it reads besides the messages it is fed is given when it is made or opened: the
session (snapshot_every=) and the restart budget, which only decide; and at start()
the codec (:class:`~reactor_dist.caller.calls.CallPath`), of which it uses only the
decoding of what arrived and the ledgers' bookkeeping (``take_item``, ``discard``,
``outcomes``, ``collectives``), never a send or a receive.
"""

from __future__ import annotations

import collections
import enum
import logging
from collections.abc import Callable
from concurrent.futures import Future
from time import perf_counter
from typing import Any, Protocol

from ..errors import CallQueueFull, WorkerCrashed, WorkerTimeout, failed_behind, queue_full
from ..wire.protocol import Field, Hot, Kind, Method, Status
from .calls import (
    ACKNOWLEDGED,
    Call,
    any_raised,
    rank_seconds,
)
from .fault_log import one_line
from .observers import (
    CANCELLED,
    CRASHED,
    DESYNC,
    OK,
    RAISED,
    TIMED_OUT,
    CallEnd,
    CallRecord,
    Observer,
    tell,
)
from .outcome import UNUSABLE_ENDING, Verdict, judge
from .timings import Recorder


class State(enum.Enum):
    """The runner's state; only ``HEALTHY`` sends calls."""

    NEW = "new"
    HEALTHY = "healthy"
    RESTARTING = "restarting"
    UNUSABLE = "unusable"
    CLOSED = "closed"

    def __str__(self) -> str:
        return self.value


NEW, HEALTHY, RESTARTING, UNUSABLE, CLOSED = (
    State.NEW, State.HEALTHY, State.RESTARTING, State.UNUSABLE, State.CLOSED)

# Every allowed move: start() succeeded; broke (with the restart budget: restarting);
# restart(); a restart ended (back, or failed); shutdown() or a failed start().
MOVES: dict[State, frozenset[State]] = {
    NEW: frozenset({HEALTHY, CLOSED}),
    HEALTHY: frozenset({UNUSABLE, RESTARTING, CLOSED}),
    RESTARTING: frozenset({HEALTHY, UNUSABLE, CLOSED}),
    UNUSABLE: frozenset({RESTARTING, CLOSED}),
    CLOSED: frozenset(),
}
_KEEP: Any = object()  # move(): the failure stays what it was


class Do(enum.Enum):
    """What the engine asks its driver to do (``Engine.todo``), in order, before the
    driver lets anybody else in."""

    TAKE_OUTPUT = "forward the ranks' log records and lines so far"
    TELL_ANSWERED = "tell the ranks that every rank answered this call (a rank raised)"
    START_RESTART = "start the automatic restart the budget allowed"
    WANT_COLLECTOR = "a call in flight has nobody watching it: the collector receives"
    LOG = "one log record: (level, text)"


NOT_REPLAYED = "this call is not replayed"
SENT_AGAIN = "this call is sent again after it (retry_failed)"
SENT_TWICE = "this call was sent again once already: retry_failed sends a call once"


def say_restarting(error: BaseException, note: str, then: str = NOT_REPLAYED) -> None:
    """An automatic restart began: its note, and ``then`` (what becomes of the call), go
    into the error's message, where an application that logs ``str(error)`` sees it (a
    RankDesync's "unusable" ending gives way to it); once."""
    message = str(error)
    if note not in message:
        error.args = (f"{message.removesuffix(UNUSABLE_ENDING)}; {note}; {then}",)


class Journal(Protocol):
    """What the engine asks of a session (session.Session, snapshot_every=): it keeps
    what every answered call leaves, and says when a snapshot is due."""

    def due(self, call: Call) -> bool:
        """``call`` was sent: whether a SNAPSHOT goes right behind it."""

    def record(self, call: Call, codec: Any) -> None:
        """Every rank answered ``call`` (one that did not break the runner)."""

    def release(self, command: Any, codec: Any) -> None:
        """A call is no longer needed: its input goes back."""


class RestartPolicy(Protocol):
    """What the engine asks of the restart budget (restart.Restarts); it only decides:
    the driver starts the restart (Do.START_RESTART)."""

    def after_failure(self, exc: BaseException) -> str | None:
        """As the runner breaks: None, or the note of the restart it begins."""

    def budget_note(self) -> str:
        """The failures that used the budget, for an unusable runner's error."""


class NoRestarts:
    """max_restarts=0: a failure leaves the runner unusable."""

    def after_failure(self, exc: BaseException) -> str | None:
        return None

    def budget_note(self) -> str:
        return ""


class Engine:
    """Calls in send order, at most ``max_in_flight`` of them sent and not answered;
    ``session``, ``retry_failed`` and the restart budget are given when it is made."""

    def __init__(self, world_size: int, max_in_flight: int, timings: Recorder, *,
                 session: Journal | None = None, retry_failed: bool = False,
                 restarts: RestartPolicy | None = None) -> None:
        self.world_size, self.max_in_flight, self.timings = world_size, max_in_flight, timings
        self.session, self.retry_failed = session, retry_failed
        self.restarts: RestartPolicy = restarts if restarts is not None else NoRestarts()
        self.codec: Any = None  # the CallPath, from open() on
        self.state = NEW
        self.failure: BaseException | None = None  # why it is not healthy
        self.in_flight: collections.deque[Call] = collections.deque()
        self.by_seq: dict[int, Call] = {}
        self.turns: collections.deque[object] = collections.deque()  # callers waiting to send
        self.observers: tuple[Observer, ...] = ()  # metrics, traces (observers.py)
        # With retry_failed, the calls a fault failed wait here, with their errors, to be
        # sent again once the automatic restart is done.
        self.retrying: list[tuple[Call, BaseException]] = []
        self.retried = 0  # calls sent again after a restart, so far
        # Its outputs: what the driver does next, in order; the calls whose futures it
        # settles (outside its lock); whether waiters must look again.
        self.todo: collections.deque[tuple[Do, Any]] = collections.deque()
        self.settled: collections.deque[Call] = collections.deque()
        self.changed = False

    # -- states ----------------------------------------------------------------------------
    def move(self, to: State, failure: BaseException | None = _KEEP) -> None:
        """The one place the state changes; every waiter looks again."""
        if to not in MOVES[self.state]:
            raise RuntimeError(f"reactor_dist bug: the runner's state cannot move from "
                               f"{self.state} to {to}")
        self.state = to
        if failure is not _KEEP:
            self.failure = failure
        self.changed = True

    def open(self, codec: Any) -> None:
        """start() succeeded: calls may go; ``codec`` decodes what arrives."""
        self.codec = codec
        self.move(HEALTHY, None)

    def check_usable(self) -> None:
        """Raise why no call can go now (nothing, when healthy)."""
        state = self.state
        if state is HEALTHY:
            return
        if state is NEW:
            raise RuntimeError("start() has not run: call runner.start() (or use `with runner:`)")
        failure = self.failure
        if state is RESTARTING:  # a caller that waits for the end never gets here
            raise RuntimeError(f"this DistributedRunner is restarting after "
                               f"{type(failure).__name__}: wait for it") from failure
        if failure is None:
            raise RuntimeError("this DistributedRunner is unusable (it was shut down); build "
                               "and start a new one")
        then = "It was shut down; build and start a new one" if state is CLOSED else \
            "runner.restart() brings its ranks back (DistributedRunner(max_restarts=N) " \
            "restarts it by itself)"
        said = str(failure).removesuffix(UNUSABLE_ENDING)
        raise RuntimeError(f"this DistributedRunner is unusable: {type(failure).__name__}: "
                           f"{said}{self.restarts.budget_note()}. {then}") from failure

    def broken(self, exc: BaseException, at: Call | None = None,
               raised: bool = False) -> None:
        """The runner is unusable from now on (or restarts itself, if the budget allows):
        ``at`` (default: the call the ranks run) fails with ``exc``, every other call in
        flight with the same type of error.  ``raised``: a caller gets ``exc`` itself.
        The fault's one log line: ERROR when a caller sees it, WARNING when none does
        (retry_failed sends the failed calls again after the restart it begins)."""
        if self.state is not HEALTHY:
            return
        self.todo.append((Do.TAKE_OUTPUT, None))  # the failed calls' records first
        said = one_line(exc)  # before the restart's note goes into its message
        note = self.restarts.after_failure(exc)
        self.move(UNUSABLE if note is None else RESTARTING, exc)
        if note is not None:
            self.todo.append((Do.START_RESTART, None))
        at = at or (self.in_flight[0] if self.in_flight else None)
        if isinstance(exc, WorkerCrashed) and self.observers:
            dead = sorted({failure.rank for failure in getattr(exc, "failures", ())})
            self.observers = tell(self.observers, "died", dead)
        seen = self.fail_in_flight(lambda call: exc if call is at else failed_behind(
            exc, call.what, at.what if at is not None else None), note,
            CRASHED if isinstance(exc, WorkerCrashed) else
            TIMED_OUT if isinstance(exc, WorkerTimeout) else DESYNC,
            retry=note is not None and self.retry_failed)
        if note is not None:  # raised by a call not yet in flight (a death while idle)
            say_restarting(exc, note, SENT_AGAIN if self.retry_failed else NOT_REPLAYED)
        if note is None or seen or raised:
            self.todo.append((Do.LOG, (logging.ERROR,
                                       said if note is None else f"{said}; {note}")))
        else:  # no caller saw it
            again = ", ".join(call.what for call, _ in self.retrying)
            told = f"retry_failed sends {again} again: no caller saw an error" if again \
                else "no call failed: no caller saw an error"
            self.todo.append((Do.LOG, (logging.WARNING, f"{said}; {note}; {told}")))

    def fail_in_flight(self, error_of: Callable[[Call], BaseException],
                       note: str | None = None, outcome: str = CANCELLED,
                       retry: bool = False) -> int:
        """Every call in flight fails; the callers waiting for a turn keep it (they wait
        for a restart, or see why they cannot send).  ``retry`` (retry_failed, an
        automatic restart begins): a call somebody takes, sent once so far, waits to be
        sent again instead, its error kept for a restart that fails.  How many errors a
        caller takes."""
        seen = 0
        for call in self.in_flight:
            if not call.done:
                error = error_of(call)
                again = retry and not call.left and not call.retried and \
                    call.command is not None
                if note is not None:
                    say_restarting(error, note, SENT_AGAIN if again else
                                   SENT_TWICE if retry and call.retried else NOT_REPLAYED)
                if call.method == Method.SNAPSHOT:
                    call.settle(None, error)  # the caller's own: the last snapshot stays
                elif again:
                    self.retrying.append((call, error))
                else:
                    seen += not call.left
                    self.settle(call, None, error, outcome)
        self.in_flight.clear()
        self.by_seq.clear()
        self.changed = True
        return seen

    # -- the restart handshake -------------------------------------------------------------
    def begin_restart(self) -> bool:
        """restart() from the caller: the calls in flight fail; new ones wait for it.
        False while an automatic restart runs (the driver waits and asks again)."""
        if self.state is CLOSED:
            raise RuntimeError("this DistributedRunner was shut down: restart() brings "
                               "back a runner that broke, not one shut down; build a new one")
        if self.state is NEW:
            raise RuntimeError("start() has not run: call runner.start() first")
        if self.state is RESTARTING:
            return False
        if self.state is HEALTHY:
            self.fail_in_flight(lambda call: RuntimeError(
                f"{call.what} was in flight when runner.restart() was called: it has "
                f"no result"))
            self.move(RESTARTING, None)
        else:
            self.move(RESTARTING)
        return True

    def restart_ended(self, failure: BaseException | None) -> list[tuple[Call, BaseException]]:
        """The restart ended: healthy again, or unusable with ``failure``.  What the driver
        sends again now, in order and before any other call (retry_failed)."""
        if failure is None:
            self.move(HEALTHY, None)
            retrying, self.retrying = self.retrying, []
            return retrying
        self.move(UNUSABLE, failure)
        self.fail_retries(lambda error: f"{error}; the runner restarted to send this call "
                          f"again, and the restart failed: {type(failure).__name__}: "
                          f"{failure}")
        return []

    def resent(self, call: Call, seq: int, now: float) -> bool:
        """A retried call went again as ``seq``: in flight once more.  True when a
        snapshot is due behind it."""
        call.resent(seq, perf_counter())
        self.retried += 1
        if call.timeout is not None and not self.in_flight:
            call.deadline = now + call.timeout
        self.in_flight.append(call)
        self.by_seq[seq] = call
        if call.watchers <= 0:
            self.todo.append((Do.WANT_COLLECTOR, None))
        self.changed = True
        return self.session is not None and self.session.due(call)

    def fail_retries(self, message: Callable[[BaseException], str]) -> None:
        """The calls waiting to be sent again fail with the error the fault gave them."""
        retrying, self.retrying = self.retrying, []
        for call, error in retrying:
            error.args = (message(error),)
            self.settle(call, None, error, CANCELLED)

    def close(self) -> None:
        """Shut down: the calls in flight fail, and those waiting to be sent again."""
        self.move(CLOSED)
        self.fail_in_flight(lambda call: RuntimeError(
            f"{call.what} was still in flight when the runner was shut down: it has no "
            f"result"))
        self.fail_retries(lambda error: f"{error}; the runner was shut down before this "
                          f"call was sent again")

    # -- turns -----------------------------------------------------------------------------
    def free_to_send(self) -> bool:
        """The fast path of threads and tasks alike: a call may go now, with no turn (no
        caller waiting for one, healthy, room in flight)."""
        return not self.turns and self.state is HEALTHY and \
            len(self.in_flight) < self.max_in_flight

    def take_turn(self) -> object:
        """A place in the line of callers waiting to send."""
        if self.state is not RESTARTING:
            self.check_usable()
        turn = object()
        self.turns.append(turn)
        return turn

    def may_send(self, turn: object) -> bool:
        """This caller may send now, or must look why not (the runner is not healthy and
        not restarting either: check_usable() raises why)."""
        state = self.state
        if state is HEALTHY:
            return self.turns[0] is turn and len(self.in_flight) < self.max_in_flight
        return state is not RESTARTING

    def not_sent(self, method: str, queue_timeout: float | None) -> CallQueueFull:
        if self.state is RESTARTING:
            return CallQueueFull(
                f"{method}() waited {queue_timeout:g} s for the runner's restart to end; "
                f"nothing was sent (the restart goes on)")
        return queue_full(method, queue_timeout, len(self.in_flight), self.max_in_flight,
                          self.in_flight[0].what if self.in_flight else "nothing")

    def leave_turn(self, turn: object) -> None:
        if turn in self.turns:
            first = self.turns[0] is turn
            self.turns.remove(turn)
            if first and self.turns:
                self.changed = True

    # -- sending ---------------------------------------------------------------------------
    def sent(self, call: Call, turn: object | None, now: float, future: Future | None,
             stream: bool = False) -> bool:
        """The driver published ``call`` (its ``turn``, if it waited for one): it is in
        flight.  True when a snapshot is due right behind it (sessions)."""
        if call.timeout is not None and not self.in_flight:  # the ranks start it now
            call.deadline = now + call.timeout
        call.stream = stream
        self.in_flight.append(call)
        self.by_seq[call.seq] = call
        if turn is not None:
            self.turns.remove(turn)
        if self.observers:
            call.record = CallRecord(call.seq, call.method, stream, call.started, call.sent)
            self.observers = tell(self.observers, "sent", call.record)
        if future is None:
            call.watchers = 1
        else:
            call.future = future
            future.set_running_or_notify_cancel()  # sent: it cannot be taken back
            self.todo.append((Do.WANT_COLLECTOR, None))
        if self.turns:
            self.changed = True
        session = self.session
        return session is not None and session.due(call)

    def snapshot_sent(self, snapshot: Call, now: float) -> None:
        """A SNAPSHOT went right behind a call (sessions): in flight, watched by nobody."""
        if snapshot.timeout is not None and not self.in_flight:
            snapshot.deadline = now + snapshot.timeout
        self.in_flight.append(snapshot)
        self.by_seq[snapshot.seq] = snapshot
        self.todo.append((Do.WANT_COLLECTOR, None))

    # -- deadlines -------------------------------------------------------------------------
    def next_deadline(self) -> float | None:
        """The moment the call the ranks run runs out of time waiting for its next reply
        or item (None: it cannot).  A call behind it has no clock yet: its own starts
        when the ranks start it, and until then the call they run is the one that can be
        late (and the one a timeout names)."""
        return self.in_flight[0].deadline if self.in_flight else None

    def overdue(self, now: float) -> Call | None:
        """The call the ranks run, if its deadline passed at ``now``: it timed out (the
        driver makes its WorkerTimeout, with the silent ranks' stacks, and breaks)."""
        due = self.next_deadline()
        return self.in_flight[0] if due is not None and now >= due else None

    def busy(self) -> list[int]:
        """The ranks that have not answered the call they run."""
        if not self.in_flight:
            return []
        head = self.in_flight[0]
        return [r for r in range(self.world_size) if r not in head.replies]

    # -- what arrives ----------------------------------------------------------------------
    def feed(self, message: tuple[dict, list], now: float) -> None:
        """One REPLY or ITEM from a rank, its ledger fields already applied; ``now``: the
        monotonic time it was taken."""
        header, body = message
        call = self.by_seq.get(header[Field.SEQ])
        if call is None:  # a failed call's, or not ours
            self.codec.discard(header)
        elif header[Field.KIND] == Kind.ITEM:
            if header[Field.RANK] == 0:
                if not call.itemized:
                    call.itemized = True
                    if self.observers and call.record is not None:
                        self.observers = tell(self.observers, "first_item", call.record,
                                              perf_counter())
                self.codec.take_item(call, header, body)
                if call.deadline is not None and call.timeout is not None:
                    call.deadline = now + call.timeout
                self.changed = True
        elif header[Field.RANK] not in call.replies:
            rank = header[Field.RANK]
            call.replies[rank] = message
            if header.get(Field.STATUS) == Status.OK:
                call.returned += 1
            if Field.COMPUTE in header:
                call.compute[rank] = header[Field.COMPUTE]
            if Field.COLLECTIVE_WAIT in header:
                call.waits[rank] = header[Field.COLLECTIVE_WAIT]
            if Field.LOGGED in header:  # its records reach the logs before its result
                call.logged = True
            in_flight = self.in_flight
            while in_flight and len(in_flight[0].replies) == self.world_size:
                self.answered(in_flight.popleft(), now)

    def ack(self, arrived: list[tuple], now: float) -> int:
        """The plain replies at the start of ``arrived`` (status OK, nothing but their
        times and maybe a small payload: HOT_HEAD's fields and the payload,
        framing.Channel.take), each counted into its call with no header map; how many
        there were.  A pass of the call queue hands over all its acknowledgements at once."""
        by_seq, ws = self.by_seq, self.world_size
        counted = 0
        for fields in arrived:
            if len(fields) == 2:  # a message decoded whole: the call queue's to dispatch
                break
            counted += 1
            _, _, flags, _, rank, seq, compute, wait, _, payload = fields
            call = by_seq.get(seq)
            if call is None or rank in call.replies:  # a failed call's: it holds no segments
                continue
            call.replies[rank] = ACKNOWLEDGED if payload is None else \
                (ACKNOWLEDGED[0], [payload])
            call.returned += 1
            if flags & Hot.COMPUTE:
                call.compute[rank] = compute
            if flags & Hot.WAIT:
                call.waits[rank] = wait
            if flags & Hot.LOGGED:
                call.logged = True
        in_flight = self.in_flight
        while in_flight and len(in_flight[0].replies) == ws:
            self.answered(in_flight.popleft(), now)
        return counted

    def owes_before(self, begun: dict[int, int | None]) -> bool:
        """A death's notice: a dead rank still owes replies to calls before the one it
        began (``begun``: by its ring; None: no ring, and then it owes more than one)."""
        for rank, seq in begun.items():
            owed = [c.seq for c in self.in_flight if rank not in c.replies]
            if (owed and seq is not None and owed[0] < seq) or (seq is None and len(owed) > 1):
                return True
        return False

    def died_in(self, dead: list[int], begun: int) -> Call | None:
        """The call the dead ranks were running: the first they had not answered and had
        begun, by their rings (``begun``, 0: not known; a reply lost with its rank fails
        its call too); None: they died between calls."""
        owed = [c for c in self.in_flight if not all(r in c.replies for r in dead)]
        return next((c for c in owed if c.seq >= begun), owed[0] if owed else None)

    def answered(self, call: Call, now: float) -> None:
        """Every rank answered ``call``: judge it; the next call starts its clock."""
        del self.by_seq[call.seq]
        if self.in_flight:
            head = self.in_flight[0]
            if head.timeout is not None:
                head.deadline = now + head.timeout
        self.changed = True
        codec = self.codec
        if call.method == Method.SNAPSHOT:  # the caller's own: no verdict, no observer
            if any_raised(call):
                self.todo.append((Do.TELL_ANSWERED, call))
            assert self.session is not None
            self.session.record(call, codec)
            call.settle(None, None)
            return
        answered = perf_counter()
        if call.logged:  # the call's log records before its result or error
            self.todo.append((Do.TAKE_OUTPUT, None))
        if call.returned == self.world_size:  # the common path: one pass, nobody judged
            first = codec.returned(call)
            verdict = Verdict(first.value, first.error, False)
        else:
            verdict = judge(call.method, codec.outcomes(call), lambda: codec.collectives(call))
        if (self.timings.enabled or self.observers) and not call.left:
            times = (call.started, call.sent, answered, perf_counter())
            compute, waits = rank_seconds(call, self.world_size)
            if self.timings.enabled:
                self.timings.record(*times, compute, waits)
            if call.record is not None:
                call.measured = times, compute, waits
        if verdict.breaks:
            self.in_flight.appendleft(call)  # fails first, with the error itself
            self.broken(verdict.error, call)  # type: ignore[arg-type]
            return
        if call.returned != self.world_size and any_raised(call):
            self.todo.append((Do.TELL_ANSWERED, call))
        if self.session is not None:
            self.session.record(call, codec)
        self.settle(call, verdict.value, verdict.error, OK if verdict.error is None else RAISED)

    def settle(self, call: Call, value: Any, error: BaseException | None,
               outcome: str) -> None:
        if call.left:
            value, outcome = None, CANCELLED  # nobody takes it: its memory goes back
        if call.command is not None and self.session is not None:  # failed: not kept
            self.session.release(call.command, self.codec)
            call.command = None
        call.settle(value, error)
        if self.observers and call.record is not None:
            self.observers = tell(self.observers, "settled", call.record,
                                  CallEnd(outcome, error, *(call.measured or ())))
        if call.future is not None:
            self.settled.append(call)

    # -- leaving ---------------------------------------------------------------------------
    def unwatch(self, call: Call) -> None:
        """A caller stops waiting for ``call`` (it may come back)."""
        call.watchers -= 1
        if call.watchers <= 0 and not call.done:
            self.todo.append((Do.WANT_COLLECTOR, None))

    def leave(self, call: Call) -> None:
        """Nobody takes ``call``'s value or items any more: the ranks still finish it,
        and what it brings goes back unread."""
        call.left = True
        call.items.clear()
        call.watchers = 0
        if not call.done:
            self.todo.append((Do.WANT_COLLECTOR, None))

    def unwatched(self) -> bool:
        return any(call.watchers <= 0 for call in self.in_flight)

    def answered_so_far(self) -> Callable[[], bool]:
        """What says that every call sent so far is answered, or that the runner broke or
        was shut down (a restart in progress is waited for)."""
        last = self.in_flight[-1] if self.in_flight else None
        return lambda: self.state is not RESTARTING and (
            self.state is not HEALTHY or last is None or last.done)
