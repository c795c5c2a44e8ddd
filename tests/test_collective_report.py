"""A hang or a mismatch in a collective names the rank, the collective and the shapes
(issue 45): each rank's ring in /dev/shm, read by the caller while a rank hangs and
after it died, at world_size 2 and 3, on CPU with gloo.

The last rank of ``Collectives`` does what each case says (tests/collective_workers.py);
each test asserts the error's type, its first line exactly, each rank's line, and each
failure record's ``collective``."""

from __future__ import annotations

import os
import re

import pytest
from collective_workers import Collectives

from reactor_dist import (
    DistributedRunner,
    RankDesync,
    WorkerCrashed,
    WorkerTimeout,
)
from reactor_dist.shm import collective_ring
from reactor_dist.shm.collective_ring import Entry, report

CALL = 2  # generate("ok") is call 1, the case call 2

EXPECTED = {
    # case: (type, {world_size: first line})
    "skip": (WorkerTimeout, {
        2: "rank 1 never entered all_reduce #2 of call 2; rank 0 waits in it",
        3: "rank 2 never entered all_reduce #2 of call 2; ranks 0 and 1 wait in it"}),
    "shape": (WorkerCrashed, {
        2: "all_reduce #1 of call 2: rank 0 has [4] float32, rank 1 has [8] float32 — "
           "the shapes differ",
        3: "all_reduce #1 of call 2: ranks 0 and 1 have [4] float32, rank 2 has [8] "
           "float32 — the shapes differ"}),
    "kind": (WorkerTimeout, {
        2: "rank 0 is in all_reduce #1, rank 1 in broadcast #1 of call 2 — the ranks "
           "called different collectives",
        3: "ranks 0 and 1 are in all_reduce #1, rank 2 in broadcast #1 of call 2 — the "
           "ranks called different collectives"}),
    "kind_raise": (RankDesync, {
        2: "rank 0 is in all_reduce #1, rank 1 in broadcast #1 of call 2 — the ranks "
           "called different collectives",
        3: "ranks 0 and 1 are in all_reduce #1, rank 2 in broadcast #1 of call 2 — the "
           "ranks called different collectives"}),
    "die": (WorkerCrashed, {
        2: "rank 1 died inside all_reduce #1 of call 2; rank 0 never entered it",
        3: "rank 2 died inside all_reduce #1 of call 2; rank 1 waits in it, rank 0 never "
           "entered it"}),
}
# Each rank's line in the message, per case: a pattern (the seconds and some states
# depend on timing: a survivor may still wait or have raised when the report is read)
SHAPE = r"\(\[4\] float32\)"
FOR = r"( for [\d.]+ s)?"  # how long it has waited, when it still waits
LINES = {
    "skip": lambda r, last: (rf"last left all_reduce #1 of call 2 {SHAPE}" if r == last
                             else rf"waits in all_reduce #2 of call 2 {SHAPE} for [\d.]+ s"),
    "shape": lambda r, last: (r"(waits in|raised in|died in) all_reduce #1 of call 2 "
                              + (r"\(\[8\] float32\)" if r == last else SHAPE)
                              + FOR),
    "kind": lambda r, last: (rf"waits in {'broadcast' if r == last else 'all_reduce'} #1 "
                             rf"of call 2 {SHAPE} for [\d.]+ s"),
    "kind_raise": lambda r, last: (rf"raised in {'broadcast' if r == last else 'all_reduce'}"
                                   rf" #1 of call 2 {SHAPE}"),
    "die": lambda r, last: (rf"died in all_reduce #1 of call 2 {SHAPE}" if r == last else
                            "no collective recorded in this call" if r == 0 else
                            rf"(waits in|raised in) all_reduce #1 of call 2 {SHAPE}{FOR}"),
}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("case", list(EXPECTED))
def test_the_error_says_which_collective_differs_and_where_each_rank_is(case, world_size):
    kind, first_lines = EXPECTED[case]
    last = world_size - 1
    with DistributedRunner(Collectives, world_size=world_size, device="cpu",
                           call_timeout=3.0, start_timeout=60, shutdown_grace=1.0) as runner:
        assert runner.generate("ok") == 4 * world_size * world_size  # two all_reduces
        with pytest.raises(kind) as caught:
            runner.generate(case)
    error = caught.value
    text = str(error)
    assert text.split("\n")[0] == first_lines[world_size]
    block = text.split("the ranks' collectives:\n", 1)[1].split("\nthe silent", 1)[0]
    block = block.split("\ntheir torch groups' flight recorders:", 1)[0]
    got = dict(re.findall(r"^  rank (\d+): (.*)$", block, re.M))
    assert sorted(map(int, got)) == list(range(world_size))
    for rank, line in got.items():
        assert re.fullmatch(LINES[case](int(rank), last), line), (rank, line)
    records = {f.rank: f.collective for f in error.failures}
    assert records and all(records[r] == got[str(r)] for r in records)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("case", ["skip", "kind"])
def test_a_timeout_adds_each_ranks_torch_flight_recorder(case, world_size):
    """What the process group itself saw, from torch's flight recorder (gloo keeps one
    too), read by a thread of each rank while its main thread waits in the collective.
    Call 1 made the group's collectives #1 and #2."""
    last = world_size - 1
    with DistributedRunner(Collectives, world_size=world_size, device="cpu",
                           call_timeout=3.0, shutdown_grace=1.0) as runner:
        runner.generate("ok")
        with pytest.raises(WorkerTimeout) as caught:
            runner.generate(case)
    block = str(caught.value).split("their torch groups' flight recorders:\n", 1)[1]
    got = dict(re.findall(r"^  rank (\d+): (.*)$", block.split("\nthe silent", 1)[0], re.M))
    waiting = ("gloo's recorder: not finished: gloo:all_reduce #4 of group default_pg "
               "([4] Float), scheduled")
    expected = {
        "skip": "gloo's recorder: every one finished; the last: gloo:all_reduce #3 of group "
                "default_pg ([4] Float)",
        "kind": "gloo's recorder: not finished: gloo:broadcast #3 of group default_pg ([4] "
                "Float), scheduled",
    }
    if case == "kind":
        waiting = waiting.replace("#4", "#3")
    assert got == {str(r): expected[case] if r == last else waiting
                   for r in range(world_size)}
    assert "flight_recorder.py" not in str(caught.value)  # its thread is no stack shown


def test_each_rank_has_a_ring_in_dev_shm_while_started_and_none_after():
    with DistributedRunner(Collectives, world_size=2, device="cpu", call_timeout=10.0) as runner:
        assert runner.generate("ok") == 16
        rings = sorted(n for n in os.listdir("/dev/shm") if ".coll" in n and
                       n.startswith("rdist.") and str(os.getpid()) in n)
        assert [n.rsplit(".", 1)[1] for n in rings] == ["coll0", "coll1"]
        with open(os.path.join("/dev/shm", rings[1]), "rb") as f:
            ring = f.read()
        entries = collective_ring.read(ring)
        assert [(e.seq, e.index, e.kind, e.state, e.shapes) for e in entries[-2:]] == [
            (1, 1, "all_reduce", collective_ring.LEFT, "[4] float32"),
            (1, 2, "all_reduce", collective_ring.LEFT, "[4] float32")]
        assert collective_ring.begun(ring) == 1  # the call it began last
        runner.reset()  # call 2, no collective: the ring still says the rank began it
        with open(os.path.join("/dev/shm", rings[0]), "rb") as f:
            assert collective_ring.begun(f.read()) == 2
    assert not [n for n in os.listdir("/dev/shm") if ".coll" in n and str(os.getpid()) in n]


def test_record_collectives_false_makes_no_ring_and_a_failure_names_no_collective():
    """The off switch: no ring in /dev/shm, the ranks record nothing (torch's flight
    recorder neither), and a skipped collective is the plain timeout (its stacks still
    show where each rank waits); an application's own size for the recorder stays."""
    with pytest.raises(ValueError, match=r"record_collectives must be True or False, got 1"):
        DistributedRunner(Collectives, world_size=2, device="cpu", record_collectives=1)
    with DistributedRunner(Collectives, world_size=2, device="cpu", call_timeout=3.0,
                           shutdown_grace=1.0, record_collectives=False) as runner:
        assert runner.generate("ok") == 16
        # torch's flight recorder off too (torch 2.13 keeps one by default)
        assert runner.call_all("environment", "TORCH_FR_BUFFER_SIZE") == ["0", "0"]
        assert not [n for n in os.listdir("/dev/shm") if ".coll" in n and
                    str(os.getpid()) in n]
        with pytest.raises(WorkerTimeout) as caught:
            runner.generate("skip")
    text = str(caught.value)
    assert text.split("\n")[0].startswith("no answer from rank 0 within 3 s during "
                                          "generate() (call 3)")
    assert "the ranks' collectives" not in text and "all_reduce" in text  # rank 0's stack
    assert [f.collective for f in caught.value.failures] == [None]
    assert "flight recorders" not in text
    with DistributedRunner(Collectives, world_size=2, device="cpu", record_collectives=False,
                           env={"TORCH_FR_BUFFER_SIZE": "16"}) as runner:
        assert runner.call_all("environment", "TORCH_FR_BUFFER_SIZE") == ["16", "16"]


def test_the_ring_entry_cost_diagnostics_ring_has_no_file_once_mapped():
    """benchmarks.ring_entry_cost's ring: written through its mapping, its /dev/shm file
    already gone, so that no way of ending the diagnostic leaves one behind."""
    from benchmarks.ring_entry_cost import mapped_ring

    def its_files() -> set[str]:  # (the tests beside it make and remove files of their own)
        return {name for name in os.listdir("/dev/shm") if name.startswith("rd-ring-cost-")}

    before = its_files()
    ring = mapped_ring()
    try:
        assert its_files() - before == set()
        ring.begin(7)
        assert ring.enter(collective_ring.KIND_CODE["all_reduce"], [], (0, ())) == 0
        assert collective_ring.begun(ring.mm[:]) == 7
        assert [(e.seq, e.kind) for e in collective_ring.read(ring.mm[:])] == [(7, "all_reduce")]
    finally:
        ring.mm.close()


def test_every_form_of_entry_reads_back_as_written_and_the_ring_keeps_the_newest():
    """The one-pack path (one tensor, every rank) and the whole one (no tensor, two, a
    list, a subgroup, a peer, more dims than kept, a size past 32 bits) read back as
    written; past SLOTS entries the oldest go, and the count a writer mapping the ring
    again (a spare that took the rank's place) goes on from is the entries'."""
    from benchmarks.ring_entry_cost import mapped_ring

    code = collective_ring.KIND_CODE
    ring = mapped_ring()
    try:
        ring.begin(3)
        assert ring.enter_one(code["all_reduce"], 1, (4, 5)) == 0
        ring.mark(0, collective_ring.LEFT)
        ring.enter_one(code["broadcast"], 4, ())  # a 0-dim tensor
        ring.enter_one(code["all_reduce"], 1, tuple(range(1, 11)))  # 10 dims: none kept
        ring.enter_one(code["all_reduce"], 1, (2**33, 2))  # past 32 bits: "huge"
        ring.enter(code["barrier"], [], (0, ()))
        ring.enter(code["all_gather"], [(1, (4,), 3), (1, (12,), 0)], (0, ()))
        ring.enter(code["all_reduce"], [(2, (8,), 0)],
                   collective_ring.group_key(range(1, 11), 16))
        ring.enter(code["send"], [(1, (4,), 0)], (0, ()), peer=1)
        entries = collective_ring.read(ring.mm[:])
        got = [(e.seq, e.index, e.number, e.state, e.kind, e.shapes, e.group, e.peer)
               for e in entries]
        assert got == [
            (3, 1, 1, collective_ring.LEFT, "all_reduce", "[4, 5] float32", (), -1),
            (3, 2, 1, collective_ring.IN, "broadcast", "[] bfloat16", (), -1),
            (3, 3, 2, collective_ring.IN, "all_reduce", "[?] float32", (), -1),
            (3, 4, 3, collective_ring.IN, "all_reduce", "[huge, 2] float32", (), -1),
            (3, 5, 1, collective_ring.IN, "barrier", "no tensor", (), -1),
            (3, 6, 1, collective_ring.IN, "all_gather",
             "3 x [4] float32, [12] float32", (), -1),
            (3, 1, 4, collective_ring.IN, "all_reduce", "[8] float64",
             (1, 2, 3, 4, 5, 6, 7, 8), -1),
            (3, 7, 1, collective_ring.IN, "send", "[4] float32", (), 1)]
        for n in range(len(entries), collective_ring.SLOTS + 5):
            ring.enter_one(code["all_reduce"], 1, (n,))
        entries = collective_ring.read(ring.mm[:])
        assert len(entries) == collective_ring.SLOTS
        assert entries[0].kind == "all_gather"  # entries 0 to 4 overwritten
        assert [e.shapes for e in entries[3:4] + entries[-1:]] == [
            "[8] float32", f"[{collective_ring.SLOTS + 4}] float32"]
        # what a writer mapping it again starts from
        assert collective_ring.written(ring.mm) == ring.count == collective_ring.SLOTS + 5
    finally:
        ring.mm.close()


def test_the_recorder_answer_area_keeps_the_newest_entries_that_fit():
    """A rank's flight recorder answer (collective_ring.write_recorded): read back whole,
    counted, the oldest entries dropped when they do not fit; each described in a line."""
    from benchmarks.ring_entry_cost import mapped_ring

    def fr(seq: int, retired: bool, name: str = "gloo:all_reduce") -> dict:
        return collective_ring.recorder_entry({
            "profiling_name": name, "process_group": ("0", "default_pg"),
            "collective_seq_id": seq, "p2p_seq_id": 0, "is_p2p": False,
            "input_sizes": [[4, 2]], "input_dtypes": ["Float"], "state": "scheduled",
            "retired": retired}, "gloo")

    ring = mapped_ring()
    try:
        assert collective_ring.recorded(ring.mm) == (0, [])
        collective_ring.write_recorded(ring.mm, [fr(1, True), fr(2, False), fr(3, False)])
        count, entries = collective_ring.recorded(ring.mm)
        assert count == 1 and [e["collective_seq_id"] for e in entries] == [1, 2, 3]
        assert collective_ring.describe_recorded(entries) == (
            "gloo's recorder: not finished: gloo:all_reduce #2 of group default_pg ([4, 2] "
            "Float), scheduled; gloo:all_reduce #3 of group default_pg ([4, 2] Float), scheduled")
        assert collective_ring.describe_recorded(entries[:1]) == (
            "gloo's recorder: every one finished; the last: gloo:all_reduce #1 of group default_pg "
            "([4, 2] Float)")
        assert collective_ring.describe_recorded([]) == "nothing recorded"
        many = [fr(n, True, name="gloo:" + "x" * 200) for n in range(200)]  # ~50 KB
        collective_ring.write_recorded(ring.mm, many)
        count, entries = collective_ring.recorded(ring.mm)
        assert count == 2 and 0 < len(entries) < 200
        assert entries == many[-len(entries):]  # the newest kept
    finally:
        ring.mm.close()


def test_a_cuda_ranks_recorders_are_merged_by_time_and_named():
    """NCCL's recorder and gloo's, as a CUDA rank's group has both: their newest entries
    in the order they were created, one both returned counted once, each named."""
    from reactor_dist.rank import flight_recorder

    def raw(seq: int, at: int, name: str, state: str = "completed") -> dict:
        return {"profiling_name": name, "process_group": ("0", "default_pg"),
                "collective_seq_id": seq, "p2p_seq_id": 0, "is_p2p": False,
                "input_sizes": [[4]], "input_dtypes": ["Float"], "state": state,
                "retired": state == "completed", "time_created_ns": at}

    nccl = [raw(1, 100, "nccl:all_reduce"), raw(2, 300, "nccl:all_reduce", "started")]
    gloo = [raw(1, 200, "gloo:all_gather"), raw(1, 100, "nccl:all_reduce")]
    entries = flight_recorder.merged({"NCCL": nccl, "gloo": gloo})
    assert [(e["recorder"], e["name"]) for e in entries] == [
        ("NCCL", "nccl:all_reduce"), ("gloo", "gloo:all_gather"), ("NCCL", "nccl:all_reduce")]
    assert collective_ring.describe_recorded(entries) == (
        "NCCL and gloo's recorders, merged by time: not finished: nccl:all_reduce #2 of "
        "group default_pg ([4] Float), started")
    many = flight_recorder.merged({"gloo": [raw(n, n, "gloo:barrier") for n in range(20)]})
    assert [e["collective_seq_id"] for e in many] == list(range(12, 20))  # the 8 newest
    # A CPU rank reads gloo's alone: this torch has no NCCL recorder to ask for there.
    assert set(flight_recorder.traces("cpu")) <= {"gloo"}


def entry(seq: int, index: int, kind: str, state: int, shape: tuple[int, ...] = (4,),
          dtype: str = "float32", group: tuple[int, ...] = (), number: int | None = None
          ) -> Entry:
    return Entry(seq, index, index if number is None else number, state, kind, group,
                 1 if group else 0, 0.0, -1, ((dtype, shape, 0),))


def test_the_report_of_dtypes_and_of_a_subgroup():
    IN = collective_ring.IN
    dtypes = report({0: [entry(5, 1, "all_reduce", IN)],
                     1: [entry(5, 1, "all_reduce", IN, dtype="bfloat16")]}, 5)
    assert dtypes.headline == ("all_reduce #1 of call 5: rank 0 has [4] float32, rank 1 "
                               "has [4] bfloat16 — the dtypes differ")
    assert dtypes.differ
    sub = report({0: [entry(5, 1, "all_gather", IN, group=(0, 2))], 1: [],
                  2: [entry(5, 1, "all_gather", collective_ring.LEFT, group=(0, 2))]}, 5)
    assert sub.headline == ""  # rank 1 is no member of the group: nothing differs
    assert sub.lines[1] == "no collective recorded in this call"
    assert report({0: [], 1: []}, 5) is None
