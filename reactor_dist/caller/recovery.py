"""restart(): bring the ranks back to what start() leaves, keeping those that are fine.

The caller's side of one restart (the call queue holds every call meanwhile)::

    caller                                                ranks
    DROP (SEQ: the last call sent) ------------------->  each skips calls up to it
    GROUP_ABORT_SIGNAL to each live rank (rejoin()) -->  closes the old group's
                                                          connections: every collective
                                                          of the failed step raises
    a new epoch: the old death watch ends, its notices are stale
    who keeps its model (only if the worker defines rejoin() and the DROP went out to
      every rank: a full pipe refuses it to all, XPUB_NODROP): alive, and answers
      a PING within the grace period (one that does not is stopped, or hangs in the
      model's own code; a rank known dead is not waited for)
    end the others; forget what they held (rank 0 ended: its result segments go)
    a loaded spare takes an ended rank's place, while there is one (reactor_dist.caller.spares)
    start a replacement per other ended rank (same rank, GPU, Ray bundle)
    PING -> PONG from each replacement (rank 0's: its store port across nodes)
    rank 0 kept or taken: REJOIN [0] -> PROGRESS (its new store's port)
    REJOIN [kept, taken], INIT [replaced] (EPOCH, PORT) ->  kept: leave the old group,
                                                           join the new, rejoin()
                                                          spare (TAKERS): becomes the
                                                           rank, joins, rejoin()
                                                          replaced: join, load()
    REJOINED (kept), READY (replaced) <----------------

A kept rank keeps its process and its worker object: its tensors, weights, compiled
code and caches.  It must rebuild in ``rejoin()`` whatever depends on the old group:
sub-groups, communicators, and any state of the step that failed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple

from .. import timeouts
from ..errors import WorkerTimeout
from ..wire.protocol import Field, Kind
from .bus import CommandBlocked
from .supervisor import Ask, Supervisor, raise_first_error


class Restarted(NamedTuple):
    """What one restart did (for the log record and ``stats()``)."""

    replaced: list[int]  # ranks that got a new process and ran load()
    kept: list[int]  # ranks that kept their process and model (rejoin())
    seconds: float
    taken: list[int] = []  # ranks whose place a loaded spare took (rejoin(), no load())


def restart(supervisor: Supervisor, *, rejoin: bool, grace: float, timeout: float | None,
            last_seq: int, other: Callable[[dict[str, Any]], None]) -> Restarted:
    """Replace the ranks that are gone (every rank, without ``rejoin``); raises what
    start() would, or WorkerCrashed / WorkerTimeout."""
    began = time.monotonic()
    deadline = timeouts.deadline_of(timeout)
    bus, ranks = supervisor.bus, supervisor.ranks
    assert bus is not None and ranks is not None
    # A rank's full pipe refuses the DROP to every rank (XPUB_NODROP: all or none): then
    # no rank may keep its model, since a kept rank would run the failed calls first.
    try:  # one try: no time of the restart's goes to a stopped rank's pipe
        dropped = bus.publish({Field.KIND: Kind.DROP, Field.SEQ: last_seq},
                              deadline=time.monotonic())
    except CommandBlocked:
        dropped = False
    alive = [r for r, proc in enumerate(ranks.procs) if proc.alive()]
    if rejoin and dropped:  # the survivors leave the failed step, wherever they wait in it
        supervisor.abort_groups(alive)
    supervisor.new_epoch()  # deaths from here on are this restart's business
    kept = responsive(supervisor, alive, min(grace, max(deadline - began, 0.0)), other) \
        if rejoin and alive and dropped else []
    gone = [r for r in range(supervisor.world_size) if r not in kept]
    takers = supervisor.take_spares(gone) if rejoin else {}  # the first ranks get them
    supervisor.replace(gone, takers)
    replaced = [r for r in gone if r not in takers]
    epoch = supervisor.epoch
    pongs = supervisor.ping(frozenset(replaced), deadline, timeout, "restart()", other)
    port = (pongs[0][0].get(Field.PORT) or 0) if 0 in pongs else 0
    joining = sorted(kept + list(takers))  # each keeps its model: REJOIN, rejoin()
    address = supervisor.placement.store_address()  # rank 0's node now (a spare's?)

    def rejoin_command(ranks: list[int]) -> dict[str, Any]:
        command = {Field.KIND: Kind.REJOIN, Field.SEQ: 0, Field.EPOCH: epoch,
                   Field.RANKS: ranks,
                   Field.TAKERS: [[takers[r].slot, r] for r in ranks if r in takers]}
        if address:
            command[Field.ADDRESS] = address
        return command

    progress = frozenset({Kind.PROGRESS})
    if 0 in joining:  # rank 0 opens the new group's store first (across nodes: a new port)
        told = supervisor.exchange([Ask(rejoin_command([0]), Kind.PROGRESS, frozenset({0}))],
                        deadline - time.monotonic(), timeout, "restart()", other=other)
        port = told[0][0].get(Field.PORT) or 0
    asks = [Ask({Field.KIND: Kind.INIT, Field.SEQ: 0, Field.EPOCH: epoch, Field.PORT: port,
                 Field.RANKS: replaced}, Kind.READY, frozenset(replaced), progress)]
    if joining:
        others = [r for r in joining if r != 0]
        asks.append(Ask({**rejoin_command(others), Field.PORT: port},
                        Kind.REJOINED, frozenset(others), progress))
        if 0 in joining:  # has its REJOIN: nothing more to send it
            asks.append(Ask({}, Kind.REJOINED, frozenset({0}), progress))
    answers = supervisor.exchange(asks, deadline - time.monotonic(), timeout, "restart()",
                       first_error=True, other=other)
    raise_first_error(answers)
    supervisor.remove_old_stores()
    for rank in replaced:
        seconds = answers[rank][0].get(Field.LOAD_SECONDS)
        if isinstance(seconds, float):
            supervisor.load_seconds[rank] = seconds
    return Restarted(replaced, kept, time.monotonic() - began, sorted(takers))


def responsive(supervisor: Supervisor, alive: list[int], grace: float,
               other: Callable[[dict[str, Any]], None]) -> list[int]:
    """The ranks of ``alive`` that answer a PING within ``grace`` seconds: a rank still
    inside the failed step (a collective with a peer that is gone) answers once it
    leaves it; one that does not in time is replaced."""
    try:
        pongs = supervisor.ping(frozenset(alive), time.monotonic() + grace, grace,
                               "restart()", other, partial=True)
    except WorkerTimeout:
        return []
    return sorted(r for r in pongs if supervisor.ranks.procs[r].alive())  # type: ignore[union-attr]
