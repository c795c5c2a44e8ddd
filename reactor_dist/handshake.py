"""The exchanges that bring ranks up: start(), and restart()'s with replaced and kept ranks.

Commands of an exchange go out on a fixed beat (PING_EVERY), whatever arrives
meanwhile, each until every rank it is for has answered it or acknowledged it: a
PUB/SUB subscriber that has just connected may miss a command (the slow joiner),
and a command that meets a full pipe is simply tried again at the next beat
(``Bus.try_publish``), so none is ever lost.  A death of the current generation of
ranks ends the exchange with WorkerCrashed; a notice of a replaced rank is stale.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from . import timeouts
from .protocol import Field, Kind, Status

if TYPE_CHECKING:
    from .supervisor import Replies, Supervisor

PING_EVERY = 0.02  # seconds between two sends of a command not yet answered
LOOK_EVERY = 0.1  # seconds: the longest receive, so that a shutdown is seen


class Ask(NamedTuple):
    """One command of an exchange: what is published, which kind each of ``ranks``
    answers, and which other kinds say that the command arrived (``acks``)."""

    command: dict[str, Any]
    answer: str
    ranks: frozenset[int]
    acks: frozenset[str] = frozenset()


def exchange(supervisor: Supervisor, asks: list[Ask], timeout: float,
             stated_timeout: float | None, what: str, first_error: bool = False,
             other: Callable[[dict[str, Any]], None] = lambda header: None,
             partial: bool = False) -> Replies:
    """Until every rank of every ask answered (each rank is in one ask): the answers.
    WorkerTimeout after ``timeout`` seconds (``stated_timeout`` is the one named;
    ``partial``: the answers so far instead), WorkerCrashed at a death (``partial``: the
    dead rank is no longer waited for).  ``first_error``:
    a RAISED answer ends the wait at once (a failed load() makes the rest pointless).
    ``other`` sees every other message.  An ask with an empty command only waits."""
    bus = supervisor.bus
    assert bus is not None and supervisor.ranks is not None
    asked = {rank: ask for ask in asks for rank in ask.ranks}
    replies: Replies = {}
    heard: set[int] = set()  # ranks that have their command
    deadline = time.monotonic() + timeout
    beat = time.monotonic()  # when the commands are next due
    while len(replies) < len(asked):
        if supervisor.closing:
            raise RuntimeError(f"the runner was shut down during {what}")
        now = time.monotonic()
        sending = len(heard) < len(asked)
        if sending and now >= beat:
            for ask in asks:
                if ask.command and not ask.ranks <= heard:
                    supervisor.publish_start_command(dict(ask.command))
            beat += PING_EVERY
            if beat <= now:  # fell behind (a slow receive): no burst to catch up
                beat = now + PING_EVERY
        left = deadline - now
        if left <= 0:
            if partial:
                return replies
            silent = sorted(r for r in asked if r not in replies)
            raise supervisor.timed_out(silent, stated_timeout, what, replies)
        wait = min(left, beat - now) if sending else min(left, LOOK_EVERY)
        message = bus.receive(timeouts.wait_ms(max(wait, 0.0)))
        if message is None:
            continue
        header = message[0]
        kind, rank = header[Field.KIND], header[Field.RANK]
        ask = asked.get(rank)
        if kind == Kind.DEATH:
            if header.get(Field.EPOCH, 0) != supervisor.epoch:
                continue  # a replaced rank's
            if not partial:
                raise supervisor.crashed(supervisor.ranks.dead() or [rank], what)
            # partial (restart()'s grace PING): the dead simply do not answer, and a
            # notice of a death before the restart (not yet read) is no failure of it
            for gone in supervisor.ranks.dead() or [rank]:
                if gone not in replies:
                    asked.pop(gone, None)
            continue
        if ask is not None and (kind == ask.answer or kind in ask.acks):
            heard.add(rank)
        if ask is not None and kind == ask.answer:
            if rank not in replies:
                replies[rank] = message
                if first_error and header.get(Field.STATUS) == Status.RAISED:
                    return {rank: message}
        elif kind == Kind.PROGRESS:
            if supervisor.display is not None:
                supervisor.display.update(header)
        else:
            other(header)
    return replies
