"""Each rank's recent collectives, in a ring in shared memory the caller reads by itself.

Why: a hang or a mismatch in a collective is the hardest failure of a parallel model,
and the rank that has it cannot tell: it waits, or gloo aborts its process.  So each
rank writes every collective it enters (its kind, group, tensors' shapes and dtypes,
its number within the call) and whether it left it, into a small ``/dev/shm`` file of
the runner's (``<runner prefix>.coll<rank>``, created by the caller before the ranks
start, removed with the runner's other entries).  The caller maps them all and reads
them while a rank hangs, and after it died, with no help from the rank; :func:`report`
compares the ranks' entries of one call and says what differs in one line.

Layout: a header of :data:`ENTRY` bytes (magic, version, slots, the call the rank began
last), then :data:`SLOTS` entries of :data:`ENTRY` bytes; entry ``n`` lives in slot
``n % SLOTS`` and ends with ``n + 1``, written last (so a reader finds the newest entry,
and only whole ones, with nothing else to write); leaving is one byte (its state).
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import time
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

MAGIC = 0x52444352  # "RDCR"
VERSION = 2
SLOTS = 256  # entries kept per rank: the calls a report can look back over
ENTRY = 128
# After the entries, the rank's answer to the caller's RECORDER_SIGNAL: its torch group's
# flight recorder (reactor_dist.rank.flight_recorder), the newest entries as JSON
RECORDER_AT = ENTRY * (SLOTS + 1)
RECORDER_SIZE = 16384
RECORDED = struct.Struct("<II")  # answers written so far, then the JSON's length
SIZE = RECORDER_AT + RECORDER_SIZE
HEAD = struct.Struct("<IHHI")  # magic, version, entry size, slots
BEGUN_AT = 16  # the seq of the call the rank began last (u32; 0: none yet)
BEGUN = struct.Struct("<I")
# seq, index (in its group, within the call), number (of its kind, within the call),
# state, kind, tensors recorded, group size (0: every rank), group hash (0: every rank),
# entered (CLOCK_MONOTONIC, the same clock in every process of the machine), peer
FIXED = struct.Struct("<IHHBBBBIdi")
GROUP_AT, GROUP_RANKS = 32, 8  # the group's first ranks, u16 each (0xFFFF: none)
GROUP = struct.Struct("<8H")
TENSOR_AT, TENSORS, DIMS = 48, 2, 8
TENSOR = struct.Struct("<BBH8I")  # dtype, dims, list length (0: one tensor), sizes
STATE_AT = 8
# The entry's place among all the rank wrote (n + 1; 0: an empty slot), written last:
# a reader sees an entry's number only once the entry is whole
ORDINAL_AT = ENTRY - 8
ORDINAL = struct.Struct("<Q")
# The common entry in one pack, its number last: the fixed part (the group's place
# zeroed: every rank's) and one tensor of n dims (n = 0..DIMS; none read past its dims)
ONE_TENSOR = tuple(struct.Struct(f"<IHHBBBBIdi4x16xBBH{n}I{ORDINAL_AT - TENSOR_AT - 4 - 4 * n}xQ")
                   for n in range(DIMS + 1))

EMPTY, IN, QUEUED, WAITING, LEFT, RAISED = range(6)
BIG = 0xFFFFFFFF  # a size that does not fit: shown as "huge"

# Collectives whose tensors may differ between ranks by design, and point-to-point ones
# (aligned apart: two ranks' sends and receives are not the same collective).
UNEVEN = frozenset({"all_to_all", "all_to_all_single", "funcol.all_to_all_single",
                    "funcol.permute_tensor"})
POINT_TO_POINT = frozenset({"send", "recv", "isend", "irecv"})

KINDS: tuple[str, ...] = (
    "?", "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_tensor", "broadcast", "barrier", "monitored_barrier", "all_to_all",
    "all_to_all_single", "gather", "scatter", "reduce", "send", "recv", "isend", "irecv",
    "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
    "funcol.all_reduce", "funcol.all_gather_tensor", "funcol.all_gather_tensor_autograd",
    "funcol.reduce_scatter_tensor", "funcol.reduce_scatter_tensor_autograd",
    "funcol.all_to_all_single", "funcol.all_to_all_single_autograd", "funcol.broadcast",
    "funcol.permute_tensor", "funcol.all_reduce_coalesced",
    "funcol.all_gather_into_tensor_coalesced", "funcol.reduce_scatter_tensor_coalesced",
)
KIND_CODE = {name: code for code, name in enumerate(KINDS)}
DTYPES: tuple[str, ...] = (
    "?", "float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8",
    "uint8", "bool", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2", "uint16",
    "uint32", "uint64",
)


def ring_name(prefix: str, rank: int) -> str:
    """Rank ``rank``'s ring among the runner's /dev/shm entries (``<prefix>.coll<rank>``)."""
    return f"{prefix}.coll{rank}"


def fresh(buffer: mmap.mmap) -> None:
    """Write an empty ring's header (the caller, before the ranks start)."""
    HEAD.pack_into(buffer, 0, MAGIC, VERSION, ENTRY, SLOTS)


class Writer:
    """A rank's side: enter a collective (an entry), then mark its state in one byte.
    It runs before every collective, where the cache and TLB are cold after the wait
    before it: the common entry is one ``pack_into`` into one page (:meth:`enter_one`)."""

    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            self.mm = mmap.mmap(fd, SIZE, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        magic, version, _, _ = HEAD.unpack_from(self.mm, 0)
        if magic != MAGIC or version != VERSION:
            raise ValueError(path)  # not a ring: install() records nothing, says nothing
        self.count = written(self.mm)  # a spare that took a rank's place goes on from it
        self.seq = 0
        self.index = 0  # collectives of every rank's group so far in this call
        self.indexes: dict[int, int] = {}  # per subgroup's hash: the same
        self.numbers = [0] * len(KINDS)  # per kind: collectives so far in this call

    def begin(self, seq: int) -> None:
        """A call begins: its collectives are numbered from 1, and the caller can tell
        that the calls before it ran to their end here (:func:`begun`)."""
        self.seq = seq
        BEGUN.pack_into(self.mm, BEGUN_AT, seq & 0xFFFFFFFF)
        self.index = 0
        self.indexes.clear()
        self.numbers = [0] * len(KINDS)

    def enter_one(self, kind: int, dtype: int, shape: Sequence[int]) -> int:
        """The common collective entered: one tensor, every rank's group, no peer; the
        entry's number (:meth:`enter` for any other)."""
        n = self.count
        index, number = self.index + 1, self.numbers[kind] + 1
        try:
            ONE_TENSOR[len(shape)].pack_into(
                self.mm, ENTRY * (1 + n % SLOTS), self.seq, index & 0xFFFF, number & 0xFFFF,
                IN, kind, 1, 0, 0, time.monotonic(), -1, dtype, len(shape), 0, *shape, n + 1)
        except (struct.error, IndexError):  # a size past 32 bits, more than DIMS dims
            return self.enter(kind, [(dtype, shape, 0)], (0, ()))
        self.index, self.numbers[kind], self.count = index, number, n + 1
        return n

    def enter(self, kind: int, tensors: Sequence, group: tuple[int, tuple[int, ...]],
              peer: int = -1) -> int:
        """Any collective entered: ``tensors`` are (dtype code, shape, list length) of
        its tensor arguments (two kept; a size past 32 bits written as BIG, more than
        DIMS dims as none); the entry's number."""
        n = self.count
        at = ENTRY * (1 + n % SLOTS)
        ghash, granks = group
        if ghash:
            index = self.indexes[ghash] = self.indexes.get(ghash, 0) + 1
        else:
            index = self.index = self.index + 1
        number = self.numbers[kind] = self.numbers[kind] + 1
        tensors = tensors[:TENSORS]
        FIXED.pack_into(self.mm, at, self.seq, index & 0xFFFF, number & 0xFFFF, IN, kind,
                        len(tensors), min(len(granks), 0xFF), ghash, time.monotonic(), peer)
        GROUP.pack_into(self.mm, at + GROUP_AT,
                        *(tuple(granks[:GROUP_RANKS]) + (0xFFFF,) * GROUP_RANKS)[:GROUP_RANKS])
        for i, (dtype, shape, listed) in enumerate(tensors):
            dims = [min(int(d), BIG) for d in shape[:DIMS]]
            TENSOR.pack_into(self.mm, at + TENSOR_AT + i * TENSOR.size, dtype,
                             min(len(shape), 0xFF), listed & 0xFFFF, *dims,
                             *(0,) * (DIMS - len(dims)))
        ORDINAL.pack_into(self.mm, at + ORDINAL_AT, n + 1)
        self.count = n + 1
        return n

    def mark(self, n: int, state: int) -> None:
        """Entry ``n`` (of :meth:`enter`) is now in ``state`` (unless overwritten)."""
        if 0 <= n and self.count - n <= SLOTS:
            self.mm[ENTRY * (1 + n % SLOTS) + STATE_AT] = state


@dataclass(frozen=True)
class Entry:
    """One collective of one rank, as the caller reads it."""

    seq: int
    index: int
    number: int
    state: int
    kind: str
    group: tuple[int, ...]  # its ranks (the first 8); () for every rank
    group_hash: int
    entered: float
    peer: int
    tensors: tuple[tuple[str, tuple[int, ...] | None, int], ...]  # dtype, shape, list

    @property
    def name(self) -> str:
        """``all_reduce #2 of call 7`` (``of load()``: outside a call)."""
        where = f"call {self.seq}" if self.seq else "load() or rejoin()"
        group = "" if not self.group_hash else \
            f" in the group of ranks {', '.join(map(str, self.group))}"
        return f"{self.kind} #{self.number}{group} of {where}"

    @property
    def shapes(self) -> str:
        """What it was given: ``[4] float32``, ``2 x [4] float32``, or ``no tensor``."""
        if not self.tensors:
            return "no tensor"
        parts = []
        for dtype, shape, listed in self.tensors:
            dims = "[?]" if shape is None else \
                f"[{', '.join('huge' if d == BIG else str(d) for d in shape)}]"
            parts.append(f"{listed} x {dims} {dtype}" if listed else f"{dims} {dtype}")
        return ", ".join(parts)


def begun(buffer: mmap.mmap | bytes) -> int:
    """The seq of the call the rank began last (0: none, or not a ring): a rank that
    died after it had answered the calls before it died in this one."""
    magic, = struct.unpack_from("<I", buffer, 0)
    return BEGUN.unpack_from(buffer, BEGUN_AT)[0] if magic == MAGIC else 0


def written(buffer: mmap.mmap | bytes) -> int:
    """How many entries the rank has written (the newest entry's number + 1)."""
    return max((ORDINAL.unpack_from(buffer, ENTRY * (1 + slot) + ORDINAL_AT)[0]
                for slot in range(SLOTS)), default=0)


def read(buffer: mmap.mmap | bytes) -> list[Entry]:
    """Every entry a ring holds, oldest first (the caller's side; no lock: a rank that
    writes meanwhile is running, and its last entry may be half new)."""
    magic, version, size, slots = HEAD.unpack_from(buffer, 0)
    if magic != MAGIC or version != VERSION or size != ENTRY or slots != SLOTS:
        return []
    count = written(buffer)
    entries = []
    for n in range(max(0, count - SLOTS), count):
        at = ENTRY * (1 + n % SLOTS)
        if ORDINAL.unpack_from(buffer, at + ORDINAL_AT)[0] != n + 1:
            continue  # being rewritten
        seq, index, number, state, kind, ntensors, gsize, ghash, entered, peer = \
            FIXED.unpack_from(buffer, at)
        group = tuple(r for r in GROUP.unpack_from(buffer, at + GROUP_AT)[:gsize]
                      if r != 0xFFFF)
        tensors = []
        for i in range(min(ntensors, TENSORS)):
            dtype, ndim, listed, *dims = TENSOR.unpack_from(buffer, at + TENSOR_AT +
                                                           i * TENSOR.size)
            shape = tuple(dims[:ndim]) if ndim <= DIMS else None
            tensors.append((DTYPES[dtype] if dtype < len(DTYPES) else "?", shape, listed))
        entries.append(Entry(seq, index, number, state,
                             KINDS[kind] if kind < len(KINDS) else "?", group, ghash,
                             entered, peer, tuple(tensors)))
    return entries


def recorder_entry(entry: dict, recorder: str) -> dict:
    """One entry of torch's flight recorder dump (``recorder``'s: "NCCL" or "gloo"), cut
    to what :func:`describe_recorded` shows (the rank's side; the keys of the answer
    area's JSON)."""
    group = entry.get("process_group")
    return {
        "recorder": recorder,
        "name": entry.get("profiling_name"),
        "group": group[1] if isinstance(group, (list, tuple)) and len(group) > 1 else group,
        "collective_seq_id": entry.get("collective_seq_id"),
        "p2p_seq_id": entry.get("p2p_seq_id"), "is_p2p": bool(entry.get("is_p2p")),
        "input_sizes": entry.get("input_sizes"), "input_dtypes": entry.get("input_dtypes"),
        "state": entry.get("state"), "retired": bool(entry.get("retired")),
    }


def write_recorded(buffer: mmap.mmap, entries: list[dict]) -> None:
    """The rank's side: its flight recorder's newest ``entries`` (the oldest dropped
    until they fit), then the count of answers, so that the caller sees a new one whole."""
    answers, _ = RECORDED.unpack_from(buffer, RECORDER_AT)
    data = b"[]"
    for first in range(len(entries) + 1):
        data = json.dumps(entries[first:], separators=(",", ":")).encode()
        if len(data) <= RECORDER_SIZE - RECORDED.size:
            break
    buffer[RECORDER_AT + RECORDED.size:RECORDER_AT + RECORDED.size + len(data)] = data
    RECORDED.pack_into(buffer, RECORDER_AT, answers + 1, len(data))


def recorded(buffer: mmap.mmap | bytes) -> tuple[int, list[dict]]:
    """The caller's side: how many answers the rank wrote, and its latest."""
    answers, length = RECORDED.unpack_from(buffer, RECORDER_AT)
    if not answers or length > RECORDER_SIZE - RECORDED.size:
        return answers, []
    start = RECORDER_AT + RECORDED.size
    try:
        entries = json.loads(bytes(buffer[start:start + length]))
    except ValueError:  # being rewritten
        return answers, []
    return answers, entries if isinstance(entries, list) else []


def describe_recorded(entries: list[dict]) -> str:
    """One rank's flight recorders in a line: which were read, the collectives it has
    not finished (the oldest first), else the last it finished."""
    if not entries:
        return "nothing recorded"

    def one(e: dict) -> str:
        sizes = ", ".join(f"[{', '.join(map(str, s))}]" for s in e.get("input_sizes") or [])
        dtypes = ", ".join(e.get("input_dtypes") or [])
        what = f"{sizes} {dtypes}".strip() or "no tensor"
        seq = e.get("p2p_seq_id") if e.get("is_p2p") else e.get("collective_seq_id")
        return f"{e.get('name', '?')} #{seq} of group {e.get('group', '?')} ({what})"

    read = sorted({str(e.get("recorder", "?")) for e in entries})
    which = f"{read[0]}'s recorder" if len(read) == 1 else \
        f"{' and '.join(read)}'s recorders, merged by time"
    open_ = [e for e in entries if not e.get("retired")]
    if open_:
        return f"{which}: not finished: " + "; ".join(f"{one(e)}, {e.get('state', '?')}"
                                                      for e in open_)
    return f"{which}: every one finished; the last: {one(entries[-1])}"


def group_key(ranks: Sequence[int], world_size: int) -> tuple[int, tuple[int, ...]]:
    """A group's hash and ranks as entries keep them; (0, ()) for every rank."""
    ranks = tuple(ranks)
    if ranks == tuple(range(world_size)):
        return 0, ()
    return (zlib.crc32(struct.pack(f"<{len(ranks)}i", *ranks)) or 1), ranks


# -- the report ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Report:
    """What the rings say of one call: one line on what is wrong (``headline``; "" when
    nothing differs), each rank's collective (``lines``), whether the ranks disagree."""

    headline: str
    lines: dict[int, str]
    differ: bool  # the ranks called different collectives or passed different tensors

    def text(self) -> str:
        """The per-rank lines, for an error's message."""
        return "".join(f"\n  rank {r}: {line}" for r, line in sorted(self.lines.items()))


def ranks_text(ranks: Iterable[int]) -> str:
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return f"ranks {', '.join(map(str, ranks[:-1]))} and {ranks[-1]}"


def describe(entry: Entry | None, dead: bool, now: float) -> str:
    """One rank's collective, for its line and its failure record."""
    if entry is None:
        return "no collective recorded in this call"
    what = f"{entry.name} ({entry.shapes})"
    if entry.state in (IN, WAITING):
        verb = "died in" if dead else "waits in"
        return f"{verb} {what} for {max(now - entry.entered, 0.0):.1f} s" if not dead \
            else f"{verb} {what}"
    if entry.state == QUEUED:
        return f"{'died after queueing' if dead else 'queued'} {what} (not waited for)"
    if entry.state == RAISED:
        return f"raised in {what}"
    return f"{'died after' if dead else 'last left'} {what}"


def inside(entry: Entry | None) -> bool:
    return entry is not None and entry.state in (IN, WAITING, RAISED)


def report(rings: dict[int, list[Entry]], seq: int | None, dead: Iterable[int] = (),
           world_size: int | None = None, raised: dict[int, str] | None = None
           ) -> Report | None:
    """Compare the ranks' collectives of call ``seq`` (None: the latest any rank
    recorded); None when no rank recorded one.  ``raised``: the ranks that raised in the
    call (their exception's type): one that never entered a collective raised before
    it, and the headline says so."""
    dead = set(dead)
    if not any(rings.values()):
        return None
    if seq is None:
        seq = max((e.seq for entries in rings.values() for e in entries), default=0)
    now = time.monotonic()
    mine = {r: [e for e in entries if e.seq == seq] for r, entries in rings.items()}
    lines = {r: describe(entries[-1] if entries else None, r in dead, now)
             for r, entries in mine.items()}
    if not any(mine.values()):
        return None
    headline, differ = compare(mine, dead, raised or {})
    return Report(headline, lines, differ)


def compare(mine: dict[int, list[Entry]], dead: set[int],
            raised: dict[int, str] | None = None) -> tuple[str, bool]:
    """The one line on what differs between the ranks' collectives of one call."""
    groups: dict[int, tuple[int, ...]] = {0: tuple(sorted(mine))}
    for entries in mine.values():
        for e in entries:
            if e.group_hash and e.kind not in POINT_TO_POINT:
                groups.setdefault(e.group_hash, e.group)
    found: list[tuple[str, bool]] = []
    for ghash, members in groups.items():
        members = tuple(r for r in members if r in mine)
        by_rank = {r: {e.index: e for e in mine[r]
                       if e.group_hash == ghash and e.kind not in POINT_TO_POINT}
                   for r in members}
        line = compare_group(by_rank, dead, raised or {})
        if line is not None:
            found.append(line)
    differing = [f for f in found if f[1]]
    if differing:
        return differing[0]
    return found[0] if found else ("", False)


def compare_group(by_rank: dict[int, dict[int, Entry]], dead: set[int],
                  raised: dict[int, str] | None = None) -> tuple[str, bool] | None:
    if not by_rank or not any(by_rank.values()):
        return None
    reached = {r: max(entries, default=0) for r, entries in by_rank.items()}
    common = min(reached.values())
    for index in range(1, common + 1):
        at = {r: entries[index] for r, entries in by_rank.items() if index in entries}
        if len(at) < len(by_rank):
            continue  # overwritten in a ring: not comparable
        kinds = {e.kind for e in at.values()}
        if len(kinds) > 1:
            parts = []
            for kind_entries in grouped(at, lambda e: (e.kind, e.number)):
                ranks, e = kind_entries
                verb = "is in" if not parts else "in"
                if not parts and len(ranks) > 1:
                    verb = "are in"
                parts.append(f"{ranks_text(ranks)} {verb} {e.kind} #{e.number}")
            seq = next(iter(at.values())).seq
            where = f"call {seq}" if seq else "load() or rejoin()"
            return (f"{', '.join(parts)} of {where} — the ranks called different "
                    f"collectives", True)
        first = next(iter(at.values()))
        if first.kind not in UNEVEN:
            given = {r: e.tensors for r, e in at.items()}
            if len(set(given.values())) > 1:
                what = "dtypes" if len({tuple(s for _, s, _ in t) for t in given.values()}) \
                    == 1 else "shapes"
                parts = []
                for ranks, e in grouped(at, lambda e: e.tensors):
                    parts.append(f"{ranks_text(ranks)} {'has' if len(ranks) == 1 else 'have'} "
                                 f"{e.shapes}")
                return f"{first.name}: {', '.join(parts)} — the {what} differ", True
    if common < max(reached.values()):
        index = common + 1
        ahead = {r: entries[index] for r, entries in by_rank.items() if index in entries}
        behind = [r for r, n in reached.items() if n < index]
        e = next(iter(ahead.values()))
        died_in = [r for r, a in ahead.items() if r in dead and inside(a)]
        if died_in:  # a rank died inside it: that first, then who never entered it
            waiting = [r for r, a in ahead.items() if r not in dead and inside(a)]
            said = [f"{ranks_text(behind)} never entered it"]
            if waiting:
                said.insert(0, f"{ranks_text(waiting)} {'waits' if len(waiting) == 1 else 'wait'} "
                               f"in it")
            return f"{ranks_text(died_in)} died inside {e.name}; {', '.join(said)}", False
        waiting = [r for r, a in ahead.items() if a.state in (IN, WAITING) and r not in dead]
        others = [r for r in ahead if r not in waiting]
        said = []
        if waiting:
            said.append(f"{ranks_text(waiting)} {'waits' if len(waiting) == 1 else 'wait'} "
                        f"in it")
        if others:
            said.append(f"{ranks_text(others)} entered it")
        missing = [r for r in behind if r not in dead] or behind
        gone = [r for r in behind if r in dead]
        raisers = [r for r in missing if r in (raised or {})]
        quiet = [r for r in missing if r not in raisers]
        never = "; ".join(
            [f"{ranks_text(rs)} raised {kind} before {e.name}"
             for kind, rs in grouped_by(raisers, raised or {})] +
            ([f"{ranks_text(quiet)} never entered {e.name}"] if quiet else []))
        if gone and len(gone) < len(behind):
            never += f" ({ranks_text(gone)} died before it)"
        elif gone:
            never = f"{ranks_text(gone)} died before entering {e.name}"
        return f"{never}; {', '.join(said)}", True
    died_in = [r for r in by_rank if r in dead and inside(by_rank[r].get(reached[r]))]
    if died_in:
        e = by_rank[died_in[0]][reached[died_in[0]]]
        others = [r for r in by_rank if r not in dead]
        waiting = [r for r in others if inside(by_rank[r].get(e.index))]
        said = f"; {ranks_text(waiting)} {'waits' if len(waiting) == 1 else 'wait'} in it" \
            if waiting else ""
        return f"{ranks_text(died_in)} died inside {e.name}{said}", False
    waiting = [r for r in by_rank if inside(by_rank[r].get(reached[r]))]
    if waiting and len(waiting) == len(by_rank):
        e = by_rank[waiting[0]][reached[waiting[0]]]
        return f"every rank waits in {e.name}, with the same tensors", False
    return None


def grouped_by(ranks: list[int], kind: dict[int, str]) -> list[tuple[str, list[int]]]:
    """``ranks`` by their ``kind`` (an exception's type), in rank order."""
    out: dict[str, list[int]] = {}
    for r in ranks:
        out.setdefault(kind[r], []).append(r)
    return list(out.items())


def grouped(at: dict[int, Entry], key) -> list[tuple[list[int], Entry]]:
    """The ranks of ``at`` grouped by ``key`` of their entry, in rank order."""
    out: dict = {}
    for r in sorted(at):
        out.setdefault(key(at[r]), ([], at[r]))[0].append(r)
    return list(out.values())
