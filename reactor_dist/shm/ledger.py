"""Who holds which shared-memory segment: one vocabulary on both sides of the bus.

A segment is **owned** by the side that created it: the runner owns the input
segments, rank 0 owns the result segments.  The other side **maps** them.

- **hold**: a holder takes a segment (a rank will read an input; the caller will
  view a result; rank 0's worker wrote into a ``shared_empty`` array).
- **release**: a holder is done with it.  The mapping side's releases travel to
  the owner in the RELEASED field of its next message.
- **retire**: the owner unlinks an idle segment beyond the few it keeps warm.  Its
  retirements travel in the RETIRED field of its next message, and the mapping
  side unmaps them.

Why pools at all: a fresh 97 MB segment costs several memcpys' worth of page
faults, and even mapping an existing one costs about one.  So both sides keep
their segments mapped and reuse them; a segment is reused only once every holder
released it, so reuse never hands out memory somebody still reads.

Warm pools are a cache, never a hoard.  An allocation that would not fit first
retires this side's idle segments, then asks the other side to give back its own
(``reclaim``: the caller's RECLAIM round, rank 0's STARVED), and only then fails;
and idle segments are given back after IDLE_RETURN seconds without a call.

Releases often come from a finalizer (an array was collected), which may run in
any thread at any moment: :meth:`Ledger.release` and the mapped bases' finalizers
only append to a queue, which the owning thread applies at its next operation.
"""

from __future__ import annotations

import collections
import secrets
import threading
import weakref
from collections import Counter
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import numpy as np

from .segments import GRANULE, Segment, SharedMemoryExhausted, capacity

NAME_TRIES = 8  # names taken by somebody else before we give up

# How many idle segments stay warm: at least ``keep_free``, and as many as one call
# acquired among the last WARM_WINDOW calls (a stream of 8 items needs 8 every step), but
# never more than WARM_MOST for that reason.  Results held across calls do not count:
# dropping them returns their memory.
WARM_WINDOW, WARM_MOST = 32, 16
# Idle segments are given back after this many seconds without a call.
IDLE_RETURN = 2.0


class Ledger:
    """The segments one side owns and lends out; idle ones stay warm for reuse."""

    def __init__(self, directory: str, prefix: str, tag: str, keep_free: int = 2,
                 token: Callable[[], str] = lambda: secrets.token_hex(8),
                 reclaim: Callable[[int], None] | None = None,
                 before_close: Callable[[Segment], None] = lambda seg: None,
                 warm: Callable[[str], bool] = lambda name: False) -> None:
        self.directory, self.prefix, self.tag, self.keep_free = directory, prefix, tag, keep_free
        self.token = token  # a segment's name: prefix, tag and a random token (not a counter)
        # Asks the other side to give back what it keeps (its idle segments, and ours it
        # still maps) before an allocation is refused; told how many bytes are wanted.
        self.reclaim = reclaim
        self.before_close = before_close  # told before a segment is unmapped (host_pinning)
        # Whether a segment is worth more than its size (registered with CUDA: its
        # registration cost milliseconds): taken first, and kept by an idle trim.
        self.warm = warm
        self.segments: dict[str, Segment] = {}
        self.holders: dict[str, Counter] = {}  # name -> who still holds it; empty = idle
        self.idle: list[str] = []  # oldest first
        self._pending: collections.deque[tuple[str, Hashable]] = collections.deque()
        self._retired: list[str] = []
        self._per_call: collections.deque[int] = collections.deque([0], maxlen=WARM_WINDOW)

    def acquire(self, nbytes: int, what: str, holders: Iterable[Hashable]) -> Segment:
        """An idle segment of at least ``nbytes`` (smallest fit) or a new one, held by
        ``holders``; SharedMemoryExhausted when /dev/shm cannot hold it."""
        self._apply_releases()
        name = self._take_idle(nbytes)
        if name is None:
            name = self._new_segment(nbytes, what)
        self.holders[name] = Counter(holders)
        self._per_call[-1] += 1
        return self.segments[name]

    def _new_segment(self, nbytes: int, what: str) -> str:
        """A new segment; when it does not fit, our idle segments go first (they fit
        less well), then the other side gives back what it keeps (``reclaim``: our
        retired names ride on its message, so that the peers unmap them), then one
        more try: an idle segment now fits, or room for a new one."""
        size = max(GRANULE, (nbytes + GRANULE - 1) // GRANULE * GRANULE)
        try:
            seg = self._create(size, what)
        except SharedMemoryExhausted:
            if not self.idle and self.reclaim is None:
                raise
            self._retire(keep=0)
            if self.reclaim is not None:
                self.reclaim(size)
                self._apply_releases()  # what the other side let go meanwhile
                name = self._take_idle(nbytes)
                if name is not None:
                    return name
                self._retire(keep=0)
            seg = self._create(size, what)
        self.segments[seg.name] = seg
        return seg.name

    def _take_idle(self, nbytes: int) -> str | None:
        """The smallest idle segment that fits, a warm one first, taken off the idle
        list."""
        fits = [n for n in self.idle if self.segments[n].size >= nbytes]
        if not fits:
            return None
        name = min(fits, key=lambda n: (not self.warm(n), self.segments[n].size))
        self.idle.remove(name)
        return name

    def fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` can be had now without asking anybody: an idle segment
        fits, or the filesystem has room once every idle segment is retired."""
        self._apply_releases()
        if any(self.segments[n].size >= nbytes for n in self.idle):
            return True
        self._retire(keep=0)
        return capacity(self.directory)[1] >= nbytes

    def has_idle(self, keep_warm: bool = False) -> bool:
        """Whether an idle segment (or a retirement not yet told) waits: after the
        releases queued so far are applied; with ``keep_warm``, one that
        ``retire_idle(keep_warm=True)`` would retire."""
        self._apply_releases()
        if keep_warm and self.idle and not self._retired:
            warm = sum(1 for n in self.idle if self.warm(n))
            return len(self.idle) > min(warm, self.needed())
        return bool(self.idle or self._retired)

    def retire_idle(self, keep_warm: bool = False) -> list[str]:
        """Give back every idle segment now (a peer asked); with ``keep_warm`` (nobody
        called for a while) all but the warm ones that a steady stream of calls needs
        (:meth:`needed`); the names retired so far, for the RETIRED field."""
        self._apply_releases()
        if keep_warm:
            warm = [n for n in self.idle if self.warm(n)][-self.needed():]
            for name in [n for n in self.idle if n not in warm]:
                self.idle.remove(name)
                self._close(name)
        else:
            self._retire(keep=0)
        return self.take_retired()

    def needed(self) -> int:
        """How many idle segments a steady stream of calls reuses (see WARM_WINDOW)."""
        return max(self.keep_free, min(max(self._per_call), WARM_MOST))

    def _create(self, size: int, what: str) -> Segment:
        """A new segment under a fresh unpredictable name; a name somebody took first
        (/dev/shm is shared by every local user) is passed over for another."""
        for _ in range(NAME_TRIES):
            name = f"{self.prefix}.{self.tag}{self.token()}"
            try:
                return Segment.create(self.directory, name, size, what)
            except FileExistsError:
                continue
        raise SharedMemoryExhausted(
            f"cannot allocate shared memory for {what}: {NAME_TRIES} fresh names in "
            f"{self.directory} were all taken already")

    def room(self) -> int:
        """Bytes a new segment could have at most: free space plus the idle segments."""
        return capacity(self.directory)[1] + sum(self.segments[n].size for n in self.idle)

    def new_call(self) -> None:
        """A call starts: count its acquisitions apart (see WARM_WINDOW)."""
        self._per_call.append(0)

    def hold(self, name: str, holder: Hashable) -> None:
        self.holders[name][holder] += 1

    def release(self, name: str, holder: Hashable) -> None:
        """``holder`` is done with ``name`` (safe to call from a finalizer)."""
        self._pending.append((name, holder))

    def forget(self, holders: Iterable[Hashable]) -> None:
        """``holders`` are gone (ranks replaced by a restart): what they held is idle
        once nobody else holds it; they will never release it."""
        gone = set(holders)
        for name, held in self.holders.items():
            for holder in gone & held.keys():
                del held[holder]
            if not held and name not in self.idle:
                self.idle.append(name)

    def take_retired(self) -> list[str]:
        """The names retired since the last call, for the RETIRED field (called on
        every message: cheap when there is nothing to tell)."""
        if self._pending:
            self._apply_releases()
        retired = self._retired
        if retired:
            self._retired = []
        return retired

    def retired_again(self, names: list[str]) -> None:
        """Retirements taken for a message that was not sent: the next one tells them."""
        self._retired[:0] = names

    def find(self, address: int, nbytes: int) -> tuple[Segment, int] | None:
        """The segment (and offset) holding ``nbytes`` at ``address``, if one does."""
        for seg in self.segments.values():
            if seg.contains(address, nbytes):
                return seg, address - seg.address
        return None

    def close(self) -> None:
        self._pending.clear()
        for seg in self.segments.values():
            self.before_close(seg)
            seg.close(unlink=True)
        self.segments.clear()
        self.holders.clear()
        self.idle.clear()

    def _apply_releases(self) -> None:
        if not self._pending:
            return
        while self._pending:
            name, holder = self._pending.popleft()
            held = self.holders.get(name)
            if held is None or held[holder] <= 0:
                continue  # unknown, or released twice: never trust a peer's count
            held[holder] -= 1
            if held[holder] <= 0:
                del held[holder]
            if not held and name not in self.idle:
                self.idle.append(name)
        self._retire(self.needed())

    def _retire(self, keep: int) -> None:
        """Retire idle segments, the oldest cold ones first, until ``keep`` are left."""
        while len(self.idle) > keep:
            name = next((n for n in self.idle if not self.warm(n)), self.idle[0])
            self.idle.remove(name)
            self._close(name)

    def _close(self, name: str) -> None:
        """Unlink and unmap one idle segment (already off the idle list)."""
        seg = self.segments.pop(name)
        self.before_close(seg)
        seg.close(unlink=True)
        del self.holders[name]
        self._retired.append(name)


class Mapped:
    """The segments the other side owns, as mapped here.

    :meth:`base` maps a segment once and hands out uint8 arrays over it; when such an
    array is collected its release is queued for the owner (:meth:`take_released`).
    ``opener(name)`` maps one segment and returns an object with ``buffer`` and
    ``close()``; ``accept(name)`` says whether a name may be mapped at all.
    """

    def __init__(self, opener: Callable[[str], Any], accept: Callable[[str], bool],
                 unmapped: Callable[[str], None] = lambda name: None) -> None:
        self._opener, self._accept = opener, accept
        self._unmapped = unmapped  # told before a mapping is closed (staging's own)
        self.views: dict[str, Any] = {}
        self._released: collections.deque[str] = collections.deque()
        self.live: Counter = Counter()  # name -> arrays handed out and not yet collected
        # Told (from a finalizer: must never block) that a release was queued.
        self.notify: Callable[[], None] = lambda: None
        # Mapping and unmapping, which the releaser's thread does too (unmap_unused); a
        # finalizer never takes it (it may run inside base(), in this very thread).
        self._lock = threading.Lock()

    def base(self, name: str) -> np.ndarray:
        with self._lock:
            view = self.views.get(name)
            if view is None:
                if not self._accept(name):
                    raise ValueError(f"a message names a foreign segment {name!r}")
                view = self.views[name] = self._opener(name)
            base = np.frombuffer(view.buffer, np.uint8)
            self.live[name] += 1
        weakref.finalize(base, self._let_go, name)
        return base

    def _let_go(self, name: str) -> None:
        self.live[name] -= 1
        if self.live[name] <= 0:
            self.live.pop(name, None)
        self._released.append(name)
        self.notify()

    def mapped_bytes(self) -> int:
        """Bytes of the segments mapped here now."""
        with self._lock:
            return sum(getattr(view, "size", 0) for view in self.views.values())

    def unmap_unused(self) -> None:
        """Drop the mappings nobody views now (idle for a while: a cache, not a hoard;
        the owner's idle segments only free their memory once unmapped here too)."""
        with self._lock:
            unused = [(name, self.views.pop(name)) for name in list(self.views)
                      if self.live[name] <= 0]
        for name, view in unused:
            self._unmapped(name)
            view.close()

    def release(self, names: Iterable[str]) -> None:
        """Release segments that were never mapped (a discarded answer's)."""
        self._released.extend(names)

    def has_released(self) -> bool:
        return bool(self._released)

    def take_released(self) -> list[str]:
        """The names released since the last call, for the RELEASED field (called on
        every message: cheap when there is nothing to tell)."""
        released, names = self._released, []
        while released:  # another thread may take some meanwhile (releaser.py)
            try:
                names.append(released.popleft())
            except IndexError:
                break
        return names

    def unmap(self, names: Iterable[str]) -> None:
        """Drop these mappings (retired by the owner, or no longer fit for reuse)."""
        for name in names:
            with self._lock:
                view = self.views.pop(name, None) if isinstance(name, str) else None
                if view is not None and self.live[name] <= 0:
                    self.live.pop(name, None)
            if view is not None:
                self._unmapped(name)
                view.close()

    def close(self) -> None:
        self._released.clear()
        self.unmap(list(self.views))
