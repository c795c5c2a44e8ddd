"""Sessions that survive a fault: snapshots of every rank, the calls since, the replay.

With ``DistributedRunner(snapshot_every=K)`` the caller keeps, for one session::

    start()   load() ... SNAPSHOT (every rank: snapshot() -> its state, in segments of
                         its snapshot pool that the caller holds from then on)
    calls     CALL 1 .. CALL K, each in the journal (its input's segments held, rank 0's
              digest)
              SNAPSHOT after the K-th call sent (and after every reset()): once every
              rank returned it, the calls before it and the older snapshot go (their
              segments back to the ranks' pools; a dead rank's are unlinked here)
    a fault   restart (restart.py: kept ranks, spares, new processes), then
              RESTORE (every rank: restore(its state), read into its own memory)
              CALL 1' .. (the journal's calls again, in order, their results discarded;
              rank 0's digest compared with the first run's: a difference is a WARNING)
              then healthy, at the state after the last call that was answered

A snapshot lies where no rank's death can take it: the segments stay in /dev/shm
(a rank's own pool, which only its graceful shutdown unlinks) and the caller holds
their names; when a rank's process is replaced, the caller unlinks the rest of that
process's pool and, later, the snapshot's own segments of it.  What the window holds
at most: K calls sent since the last snapshot, plus the calls sent while that snapshot
was in flight (at most ``max_in_flight``), each with its input.

With ``retry_failed`` the call queue sends the calls that failed in the fault again
after the replay (:mod:`reactor_dist.caller.call_queue`); everything here runs under the
queue's lock, or in the restart while nobody else uses the bus.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from typing import NamedTuple

from .. import timeouts
from ..shm import segments
from ..wire.protocol import Field, Kind, Method, Status, segments_of, snapshot_tag
from .calls import SESSION, Call, CallPath, Command
from .engine import HEALTHY, Do, Engine
from .timings import Recorder

log = logging.getLogger("reactor_dist")
WAIT = 0.1  # seconds: the longest one receive of the replay lasts


class Entry(NamedTuple):
    """A call of the journal (answered since the last snapshot): enough to run it again
    and to tell whether the re-run gave what it gave."""

    seq: int
    what: str
    command: Command
    digest: bytes | None  # rank 0's (None: it did not return)


class Snapshot(NamedTuple):
    """Every rank's state after every call before ``seq`` (the SNAPSHOT call's)."""

    seq: int
    states: list[tuple[list | None, list]]  # per rank: descriptors, payload frames
    names: list[set[str]]  # per rank: the segments it lies in


class Session:
    """The last snapshot of every rank, the calls since it, and what a replay found."""

    def __init__(self, every: int, world_size: int, shm_dir: str, shm_prefix: str) -> None:
        self.every, self.world_size = every, world_size
        self.shm_dir, self.shm_prefix = shm_dir, shm_prefix
        self.snapshot: Snapshot | None = None
        self.journal: deque[Entry] = deque()
        self.sent_since = 0  # calls sent since the last SNAPSHOT was sent
        self.orphans: set[str] = set()  # the snapshot's segments of a process gone
        self.unlinking: list[str] = []  # orphans let go, not yet unlinked
        self.snapshots = 0  # complete snapshots taken
        self.replayed = 0  # calls run again by restarts
        self.differences = 0  # of those, how many gave rank 0 another result
        self.failure = ""  # why the last snapshot failed, if it did

    # -- while healthy (under the queue's lock) ----------------------------------------
    def due(self, call: Call) -> bool:
        """``call`` was sent: whether a SNAPSHOT goes right behind it."""
        if call.method == Method.RESET:
            return True
        self.sent_since += 1
        return self.sent_since >= self.every

    def send_snapshot(self, path: CallPath, timeout: float | None, behind: bool) -> Call:
        """Publish a SNAPSHOT: every rank's state after every call sent before it."""
        seq = path.send_numbered({Field.KIND: Kind.CALL, Field.METHOD: Method.SNAPSHOT}, [b""],
                           timeout, behind, Method.SNAPSHOT)
        self.sent_since = 0
        call = Call(seq, Method.SNAPSHOT, timeout)
        call.watchers = 0  # no caller watches it: the collector receives for it
        return call

    def record(self, call: Call, path: CallPath) -> None:
        """Every rank answered ``call`` (one that did not break the runner): a SNAPSHOT
        replaces the last one; any other call goes into the journal until the next snapshot."""
        if call.method == Method.SNAPSHOT:
            self.took(call, path)
        elif call.command is not None:
            header = call.replies[0][0]
            digest = header.get(Field.DIGEST) if header.get(Field.STATUS) == Status.OK \
                else None
            self.journal.append(Entry(call.seq, call.what, call.command, digest))
            call.command = None  # its segments are the window's now

    def took(self, call: Call, path: CallPath) -> None:
        replies = [call.replies[rank] for rank in range(self.world_size)]
        failed = [rank for rank, (header, _) in enumerate(replies)
                  if header.get(Field.STATUS) != Status.OK]
        if failed:
            for header, _ in replies:
                path.discard(header)  # the ranks that returned: their segments back
            record = replies[failed[0]][0].get(Field.ERROR) or ("?", "?", "")
            self.failure = f"rank {failed[0]} raised {record[0]}: {record[1]}"
            log.warning("snapshot() raised on rank %s (%s: %s): the session goes on from "
                        "the snapshot before it (call %d), and a restart runs the calls "
                        "since it again",
                        ", ".join(map(str, failed)), record[0], record[1],
                        self.snapshot.seq if self.snapshot else 0)
            return
        old, self.snapshot = self.snapshot, Snapshot(
            call.seq, [(header.get(Field.DESCRIPTORS), body) for header, body in replies],
            [segments_of(header.get(Field.DESCRIPTORS)) for header, _ in replies])
        self.snapshots += 1
        if old is not None:
            self.let_go(old, path)
        while self.journal and self.journal[0].seq < call.seq:
            self.release(self.journal.popleft().command, path)

    def let_go(self, old: Snapshot, path: CallPath) -> None:
        """An older snapshot's segments: back to their rank's pool, or, where the process
        that made them is gone, to be unlinked (the engine decides this; its driver
        unlinks them, :meth:`unlink_let_go`)."""
        for names in old.names:
            orphans = names & self.orphans
            self.unlinking.extend(orphans)  # by the driver (unlink_let_go)
            self.orphans -= orphans
            path.results.release(names - orphans)  # RELEASED: to the rank that owns them

    def unlink_let_go(self) -> None:
        """The segments :meth:`let_go` found orphaned: unlinked now."""
        while self.unlinking:
            segments.unlink_quietly(os.path.join(self.shm_dir, self.unlinking.pop()))

    def release(self, command: Command, path: CallPath) -> None:
        """A call is no longer needed: its input segments go back to the pool."""
        for name in command.segments:
            path.inputs.release(name, SESSION)

    # -- a restart ----------------------------------------------------------------------
    def renewed(self, ranks: list[int]) -> None:
        """These ranks have a new process: the old one's snapshot pool is unlinked, but
        for the snapshot's own segments, unlinked here once a newer one is complete."""
        keep = self.snapshot.names if self.snapshot is not None else [set()] * self.world_size
        for rank in ranks:
            segments.remove_starting(self.shm_dir, f"{self.shm_prefix}.{snapshot_tag(rank)}",
                                keep[rank])
            self.orphans |= keep[rank]

    def replay(self, path: CallPath, deadline: float) -> float:
        """Every rank restores the snapshot, then the journal's calls run again in order
        (their results discarded), fed to an engine of their own, which judges them as
        it judges every call: raises what broke it (a failed restart).  Its seconds.
        A message of another call (one that failed) is discarded: ``path.receive``
        applied its ledger fields already, once."""
        began = time.monotonic()
        assert self.snapshot is not None
        timings = Recorder(self.world_size)
        timings.enabled = False
        engine = Engine(self.world_size, len(self.journal) + 1, timings)
        engine.open(path)
        states, body = [], []
        for descriptors, frames in self.snapshot.states:
            states.append([len(body), len(frames), descriptors])
            body.extend(frames)
        calls = [Call(path.send_numbered({Field.KIND: Kind.CALL, Field.METHOD: Method.RESTORE,
                                          Field.STATES: states}, body, None, False,
                                         Method.RESTORE), Method.RESTORE, None)]
        for entry in self.journal:
            seq = path.send_again(entry.command, behind=True)
            calls.append(Call(seq, entry.command.method, entry.command.timeout))
        entries = [None, *self.journal]
        for call in calls:
            call.left = True  # rank 0's results go back unread
            engine.sent(call, None, time.monotonic(), None)
        judged = 0
        while True:
            while judged < len(calls) and calls[judged].done:
                self.judge_replay(calls[judged], entries[judged], engine)
                judged += 1
            if judged == len(calls):
                break
            if path.answered_due:  # a full pipe refused it: tried again each turn
                path.tell_answered()
            call = calls[judged]
            limit = deadline if call.deadline is None else min(deadline, call.deadline)
            now = time.monotonic()
            if now >= limit:
                raise path.supervisor.timed_out(engine.busy(), call.timeout,
                                                f"the replay of {call.what}", call.replies)
            message = path.receive(timeouts.wait_ms(min(limit - now, WAIT)))
            if message is None:
                continue
            header = message[0]
            kind = header[Field.KIND]
            if kind == Kind.DEATH:
                dead = path.supervisor.dead_of(header)
                if dead is not None:
                    raise path.supervisor.crashed(dead, f"the replay of {call.what}")
            elif kind in (Kind.REPLY, Kind.ITEM) and header[Field.SEQ] in engine.by_seq:
                engine.feed(message, time.monotonic())
                while engine.todo:  # the engine's log line: the failed restart logs instead
                    do, arg = engine.todo.popleft()
                    if do is Do.TELL_ANSWERED:
                        path.owe_answered(arg)  # kept owed by a full pipe: tried again above
                    elif do is Do.TAKE_OUTPUT:
                        path.supervisor.take_output()
            else:
                path.discard(header)
        self.replayed += len(calls) - 1
        return time.monotonic() - began

    def judge_replay(self, call: Call, entry: Entry | None, engine: Engine) -> None:
        """One call of the replay is answered: a rank that raised where it must not (a
        desync anywhere, any error in restore()) fails the restart; rank 0's digest is
        compared with the first run's."""
        error = call.error
        if error is not None and (entry is None or engine.state is not HEALTHY):
            what = "restore()" if entry is None else f"the replay of {entry.what}"
            error.args = (f"{error} (in {what} after the restart)",) if error.args else ()
            raise error
        if entry is not None and call.replies[0][0].get(Field.DIGEST) != entry.digest:
            self.differences += 1
            log.warning("the replay of %s after the restart gave rank 0 another result than "
                        "the first run: the model is not deterministic (the session goes on "
                        "from the re-run state; seed its noise and keep the RNG state in "
                        "snapshot())", entry.what, extra={"call": entry.seq})

    # -- the end --------------------------------------------------------------------------
    def close(self) -> None:
        """Shutdown: the ranks' own pools go with them; a dead process's snapshot
        segments go here (Supervisor.close removes the runner's prefix anyway)."""
        self.unlink_let_go()
        for name in self.orphans:
            segments.unlink_quietly(os.path.join(self.shm_dir, name))
        self.orphans.clear()
        self.snapshot = None
        self.journal.clear()
