"""The caller's half of giving shared memory back (the rank's half and the drawing of
the whole exchange: :mod:`reactor_dist.rank_memory`).

:class:`MemoryReturn` is a part of :class:`reactor_dist.calls.CallPath`: it passes the
caller's releases on to rank 0 (RELEASE), answers rank 0's STARVED, and runs a
RECLAIM round when an input does not fit.  None of it ever waits on a full pipe but
the reclaim round, within the call's timeout (see docs/design.md, "No command is
lost").
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from .bus import CommandBlocked
from .protocol import Field, Kind

if TYPE_CHECKING:
    from .bus import Bus
    from .ledger import Ledger, Mapped


class MemoryReturn:
    """Set by Transport: ``bus``, ``inputs`` (our pool), ``results`` (rank 0's, mapped),
    ``seq``, ``world_size``; ``wait`` and ``take_late`` come from CallPath."""

    bus: Bus | None
    inputs: Ledger
    results: Mapped
    seq: int
    world_size: int
    rounds: int = 0  # RECLAIM rounds asked (reclaim())
    hungry: int | None = None  # rank 0's STARVED round not yet answered (a full pipe)
    reclaim_timeout: float | None = None  # the call being sent's timeout bounds a reclaim

    def wait(self, deadline: float | None, what: str, replies: Any, timeout: float | None,
             quiet: bool = False) -> tuple[Any, Any]:
        raise NotImplementedError

    def take_late(self, header: dict[str, Any], body: list) -> None:
        raise NotImplementedError

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
            sent = self.bus.try_publish({Field.KIND: Kind.RELEASE, Field.SEQ: self.seq,
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
        if self.bus.try_publish({Field.KIND: Kind.RELEASE, Field.SEQ: self.seq,
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
            self.bus.publish({Field.KIND: Kind.RECLAIM, Field.SEQ: self.seq,
                              Field.ROUND: self.rounds, Field.RELEASED: released,
                              Field.RETIRED: retired}, deadline=deadline)
        except CommandBlocked:  # a rank's full pipe: the allocation fails as it would
            self.results.release(released)
            self.inputs.retired_again(retired)
            return
        answered: set[int] = set()
        while len(answered) < self.world_size:
            if deadline is not None and time.monotonic() >= deadline:
                return
            header, body = self.wait(deadline, "reclaim", {}, None, quiet=True)
            if header is None:
                continue
            if header[Field.KIND] == Kind.RECLAIMED and header.get(Field.ROUND) == self.rounds:
                answered.add(header[Field.RANK])
            else:
                self.take_late(header, body)
