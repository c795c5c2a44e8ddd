"""The segment ledger without a second process: hold, release, retire, and the
mapped side's queue of releases (what both ends of the bus do with shared memory)."""

from __future__ import annotations

import gc
import os

import pytest

from reactor_dist import SharedMemoryExhausted
from reactor_dist.shm import segments
from reactor_dist.shm.ledger import WARM_MOST, WARM_WINDOW, Ledger, Mapped
from reactor_dist.shm.segments import GRANULE


@pytest.fixture
def ledger(tmp_path):
    book = Ledger(str(tmp_path), segments.new_runner_prefix(), "t", keep_free=1)
    yield book
    book.close()
    assert os.listdir(tmp_path) == []  # close() unlinks every segment


def test_a_segment_is_reused_only_after_every_holder_released_it(ledger):
    first = ledger.acquire(100, "test", holders=[0, 1])
    ledger.release(first.name, 0)
    assert ledger.acquire(100, "test", holders=[0]).name != first.name  # rank 1 still holds it
    ledger.release(first.name, 1)
    assert ledger.acquire(100, "test", holders=[0]).name == first.name


def test_hold_adds_a_holder_that_must_release_too(ledger):
    seg = ledger.acquire(100, "test", holders=["worker"])
    ledger.hold(seg.name, "caller")
    ledger.release(seg.name, "worker")
    assert ledger.acquire(100, "test", holders=["x"]).name != seg.name
    ledger.release(seg.name, "caller")
    assert ledger.acquire(100, "test", holders=["x"]).name == seg.name


def test_idle_segments_beyond_keep_free_are_retired_oldest_first(ledger, tmp_path):
    names = []
    for _ in range(3):  # three calls, a segment each, all still held
        ledger.new_call()
        names.append(ledger.acquire(100, "test", holders=["h"]).name)
    for name in names:
        ledger.release(name, "h")
    assert ledger.take_retired() == names[:2]  # keep_free=1: the newest idle one stays warm
    assert ledger.take_retired() == []         # told once
    assert sorted(os.listdir(tmp_path)) == [names[2]]


def test_as_many_stay_warm_as_one_recent_call_used(ledger, tmp_path):
    ledger.new_call()  # a stream: three items in one call
    names = [ledger.acquire(100, "test", holders=["h"]).name for _ in range(3)]
    for name in names:
        ledger.release(name, "h")
    assert ledger.take_retired() == []  # the next step will need three again
    for _ in range(WARM_WINDOW):  # then calls of one segment, long enough to forget it
        ledger.new_call()
        ledger.release(ledger.acquire(100, "test", holders=["h"]).name, "h")
    retired = ledger.take_retired()
    assert len(retired) == 2 and set(retired) < set(names)  # keep_free=1 stays warm
    assert len(os.listdir(tmp_path)) == 1


def test_at_most_warm_most_stay_warm_for_a_big_call(tmp_path):
    book = Ledger(str(tmp_path), segments.new_runner_prefix(), "t", keep_free=2)
    try:
        book.new_call()
        names = [book.acquire(10, "test", holders=["h"]).name for _ in range(WARM_MOST + 4)]
        for name in names:
            book.release(name, "h")
        assert book.take_retired() == names[:4]  # the oldest idle ones go first
        assert len(os.listdir(tmp_path)) == WARM_MOST
    finally:
        book.close()


def test_a_release_twice_or_by_a_stranger_changes_nothing(ledger):
    seg = ledger.acquire(100, "test", holders=[0, 1])
    ledger.release(seg.name, 0)
    ledger.release(seg.name, 0)         # again
    ledger.release(seg.name, "nobody")  # never held it
    ledger.release("no-such-segment", 0)
    assert ledger.acquire(100, "test", holders=[0]).name != seg.name  # rank 1 still holds it


def test_the_smallest_idle_segment_that_fits_is_taken(ledger):
    big = ledger.acquire(3 * GRANULE, "test", holders=["h"])
    small = ledger.acquire(GRANULE, "test", holders=["h"])
    ledger.keep_free = 2
    ledger.release(big.name, "h")
    ledger.release(small.name, "h")
    assert ledger.acquire(10, "test", holders=["h"]).name == small.name
    assert ledger.acquire(2 * GRANULE, "test", holders=["h"]).name == big.name


def test_a_full_filesystem_retires_idle_segments_before_it_gives_up(tmp_path, monkeypatch):
    monkeypatch.setenv(segments.LIMIT_ENV, str(3 * GRANULE))
    book = Ledger(str(tmp_path), segments.new_runner_prefix(), "t", keep_free=2)
    try:
        idle = book.acquire(GRANULE, "test", holders=["h"])
        book.release(idle.name, "h")
        book.acquire(3 * GRANULE, "test", holders=["h"])  # fits only once the idle one is gone
        assert book.take_retired() == [idle.name]
        with pytest.raises(SharedMemoryExhausted, match="cannot allocate 4.0 MiB"):
            book.acquire(4 * GRANULE, "the test payload", holders=["h"])
    finally:
        book.close()


def test_find_locates_a_buffer_inside_a_segment(ledger):
    seg = ledger.acquire(100, "test", holders=["h"])
    assert ledger.find(seg.address + 64, 10) == (seg, 64)
    assert ledger.find(seg.address + seg.size - 5, 10) is None


def test_mapped_segments_queue_a_release_when_their_arrays_are_collected(ledger, tmp_path):
    seg = ledger.acquire(100, "test", holders=["caller"])
    mapped = Mapped(lambda name: segments.Segment.open(str(tmp_path), name),
                    lambda name: name.startswith(ledger.prefix + "."))
    try:
        base = mapped.base(seg.name)
        base[:4] = 7
        assert bytes(seg.mm[:4]) == b"\x07" * 4  # the same memory, not a copy
        assert mapped.take_released() == []
        del base
        gc.collect()
        assert mapped.take_released() == [seg.name]
        with pytest.raises(ValueError, match="foreign segment"):
            mapped.base("someone-else.in1")
        mapped.unmap([seg.name])  # retired by its owner
        assert mapped.views == {}
    finally:
        mapped.close()



def test_a_full_filesystem_asks_the_other_side_after_its_own_idle_segments(tmp_path,
                                                                           monkeypatch):
    """reclaim: called once our idle ones are retired (told with it), and what the
    other side let go meanwhile is used: an idle segment that now fits."""
    monkeypatch.setenv(segments.LIMIT_ENV, str(3 * GRANULE))
    asked: list[tuple[int, list[str]]] = []

    def reclaim(nbytes: int) -> None:
        asked.append((nbytes, book.take_retired()))
        book.release(held.name, "peer")  # the peer lets go while we wait

    book = Ledger(str(tmp_path), segments.new_runner_prefix(), "t", keep_free=2, reclaim=reclaim)
    try:
        small = book.acquire(GRANULE, "test", holders=["h"])
        book.release(small.name, "h")
        held = book.acquire(2 * GRANULE, "test", holders=["peer"])
        again = book.acquire(2 * GRANULE, "test", holders=["h"])  # does not fit: reclaim
        assert asked == [(2 * GRANULE, [small.name])]
        assert again.name == held.name  # the segment the peer let go meanwhile
        with pytest.raises(SharedMemoryExhausted, match="cannot allocate 3.0 MiB"):
            book.acquire(3 * GRANULE, "the test payload", holders=["h"])
        assert len(asked) == 2  # asked once more before the error
    finally:
        book.close()


def test_a_mapping_nobody_views_is_dropped_when_idle(ledger, tmp_path):
    seg = ledger.acquire(100, "test", holders=["caller"])
    mapped = Mapped(lambda name: segments.Segment.open(str(tmp_path), name),
                    lambda name: name.startswith(ledger.prefix + "."))
    try:
        base = mapped.base(seg.name)
        mapped.unmap_unused()
        assert list(mapped.views) == [seg.name]  # still viewed
        del base
        gc.collect()
        mapped.unmap_unused()
        assert mapped.views == {} and mapped.take_released() == [seg.name]
    finally:
        mapped.close()
