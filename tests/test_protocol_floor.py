"""The bench's protocol floor (benchmarks.implementations.protocol_floor) speaks our wire
byte for byte: a call's frame is what framing.Channel packs, and its peers' replies are
what framing.Channel.take counts.  Were it to drift from the wire, the world-size
table's "the protocol alone" rows would measure something else."""

from __future__ import annotations

import pickle

import psutil

from benchmarks.implementations.protocol_floor import ProtocolFloor, Signer, call_frame
from reactor_dist.wire import framing
from reactor_dist.wire.protocol import KIND_CODES, WIRE_VERSION, Field, Hot, Kind, Method


def test_a_call_frame_is_the_one_channel_packs() -> None:
    key = bytes(range(32))
    packed = framing.Channel(key).pack(
        {Field.KIND: Kind.CALL, Field.METHOD: Method.GENERATE, Field.SEQ: 41, Field.RANK: -1},
        [pickle.dumps({"x": 1})])
    assert packed == [call_frame(Signer(key), 41, {"x": 1})]


def test_its_replies_are_the_acknowledgements_and_result_channel_takes() -> None:
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    floor = ProtocolFloor(2)
    try:
        peers = [psutil.Process(p.pid) for p in floor.procs]
        assert floor.generate(5) == 5
        assert floor.stream(3) is None
        floor.pipelined(20, 8)
        seq = floor.publish(7)
        channel = framing.Channel(floor.key)
        taken = sorted((channel.take([floor.pull.recv()]) for _ in range(2)),
                       key=lambda fields: fields[4])
        del floor.owed[seq]
        # HOT_HEAD's fields, then the payload: rank 0's result, rank 1's acknowledgement.
        reply = KIND_CODES[Kind.REPLY]
        assert [fields[:6] for fields in taken] == [
            (WIRE_VERSION, reply, Hot.COMPUTE | Hot.EMBEDDED, Hot.OK, 0, seq),
            (WIRE_VERSION, reply, Hot.COMPUTE, Hot.OK, 1, seq)]
        assert pickle.loads(taken[0][-1]) == 7 and taken[1][-1] is None
    finally:
        floor.close()
    assert not any(p.is_running() for p in peers)
    assert {p.pid for p in psutil.Process().children(recursive=True)} == before


def test_without_the_mac_it_sends_the_same_frames_with_the_mac_zeroed() -> None:
    floor = ProtocolFloor(1, mac=False)
    try:
        assert floor.generate(3) == 3
        seq = floor.publish(4)
        frame = floor.pull.recv()
        del floor.owed[seq]
        assert frame[:32] == bytes(32)
        signed = Signer(bytes(32)).sign(frame[32:])
        assert framing.Channel(bytes(32)).take([signed])[:6] == (
            WIRE_VERSION, KIND_CODES[Kind.REPLY], Hot.COMPUTE | Hot.EMBEDDED, Hot.OK, 0, seq)
    finally:
        floor.close()
