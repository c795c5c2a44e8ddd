"""The caller's half of giving shared memory back (the rank's half and the drawing of
the whole exchange: :mod:`reactor_dist.rank.memory`).

:class:`MemoryReturn` belongs to :class:`reactor_dist.caller.calls.CallPath`: it passes the
caller's releases on to rank 0 (RELEASE), answers rank 0's STARVED, and runs a
RECLAIM round when an input does not fit.  None of it ever waits on a full pipe but
the reclaim round, within the call's timeout (see docs/design/wire.md, "No command is
lost").
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..wire.protocol import Field, Kind
from .bus import CommandBlocked

if TYPE_CHECKING:
    from ..shm.ledger import Ledger, Mapped
    from .bus import Bus


class MemoryReturn:
    """The caller's side of the memory commands, over the bus and both ledgers (ours:
    ``inputs``; rank 0's, mapped: ``results``).  ``seq`` tells the latest call's number;
    ``wait_for(done, deadline)`` receives (dispatching every other message) until
    ``done()`` or the deadline."""

    def __init__(self, bus: Bus, inputs: Ledger, results: Mapped, world_size: int,
                 seq: Callable[[], int],
                 wait_for: Callable[[Callable[[], bool], float | None], None]) -> None:
        self.bus, self.inputs, self.results = bus, inputs, results
        self.world_size, self.seq, self.wait_for = world_size, seq, wait_for
        self.rounds = 0  # RECLAIM rounds asked (reclaim())
        self.reclaimed: set[int] = set()  # ranks that answered the latest round
        self.hungry: int | None = None  # rank 0's STARVED round not yet answered (a full pipe)
        self.reclaim_timeout: float | None = None  # the call being sent's timeout bounds a reclaim

    def flush(self) -> None:
        """Before any wait of the caller: pass on the releases, and an answer to rank 0's
        STARVED that a full pipe held back (cheap when there is neither)."""
        if self.results.has_released():
            self.pass_on_releases()
        if self.hungry is not None:
            self.feed({Field.ROUND: self.hungry})

    def pass_on_releases(self) -> None:
        """Rank 0's segments the caller let go reach it now, not with the next call."""
        assert self.bus is not None
        released = self.results.take_released()
        if not released:
            return
        sent = False
        try:  # a rank's full pipe: the next message carries them (never a wait here)
            sent = self.bus.publish({Field.KIND: Kind.RELEASE, Field.SEQ: self.seq(),
                                         Field.RELEASED: released})
        finally:
            if not sent:
                self.results.release(released)

    def feed(self, starved: dict[str, Any]) -> None:
        """Rank 0 cannot allocate a result segment: everything we can give back goes to
        it now (our idle inputs retired, the caller's releases), as the answer to its
        round; rank 0 then tries once more.  By the time we read STARVED, every item
        rank 0 sent before it has been taken: what the caller still holds, it holds."""
        assert self.bus is not None
        self.hungry = starved.get(Field.ROUND)
        retired = self.inputs.retire_idle()
        released = self.results.take_released()
        if self.bus.publish({Field.KIND: Kind.RELEASE, Field.SEQ: self.seq(),
                                 Field.ROUND: self.hungry, Field.RELEASED: released,
                                 Field.RETIRED: retired}):
            self.hungry = None
        else:  # a rank's full pipe: tried again at each wait (never a wait here)
            self.results.release(released)
            self.inputs.retired_again(retired)

    def reclaim(self, nbytes: int) -> None:
        """An input of ``nbytes`` does not fit, even with our idle segments retired:
        every rank unmaps them and rank 0 gives back its idle result segments (RECLAIM,
        one RECLAIMED per rank), within the call's timeout; then the ledger tries once
        more.  A rank that does not answer in time only means the allocation fails."""
        assert self.bus is not None
        self.rounds += 1
        timeout = self.reclaim_timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        released, retired = self.results.take_released(), self.inputs.take_retired()
        try:
            self.bus.publish({Field.KIND: Kind.RECLAIM, Field.SEQ: self.seq(),
                              Field.ROUND: self.rounds, Field.RELEASED: released,
                              Field.RETIRED: retired}, deadline=deadline)
        except CommandBlocked:  # a rank's full pipe: the allocation fails as it would
            self.results.release(released)
            self.inputs.retired_again(retired)
            return
        self.reclaimed = set()
        self.wait_for(lambda: len(self.reclaimed) == self.world_size, deadline)

    def reclaimed_by(self, header: dict[str, Any]) -> None:
        """A rank's RECLAIMED (dispatched by the call queue)."""
        if header.get(Field.ROUND) == self.rounds:
            self.reclaimed.add(header[Field.RANK])
