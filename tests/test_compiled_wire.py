"""framing's compiled half (reactor_dist/wire/_framing.c) against its pure-Python path.

Both must give the same answer for every message, authentic or not: the same MAC, the
same acknowledgements and decoded commands, the same refusals.  The messages cross real
ZeroMQ sockets (ipc://), and each is sent twice, once to each path of the same Bus or
Channel.  Where a C compiler and Python's headers exist (CI), the compiled half must be
built and in use, so that the rest of the suite runs it.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import subprocess
import sys
import sysconfig
import time

import msgpack
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from reactor_dist.caller import bus as bus_module
from reactor_dist.wire import framing
from reactor_dist.wire.protocol import (
    HOT_HEAD,
    KIND_CODES,
    MAC_ONE_FRAME,
    PREFIX,
    PURE_PYTHON_ENV,
    WIRE_VERSION,
    Field,
    Hot,
    Kind,
    Method,
    Status,
)

SECRET = bytes(range(32))
compiled = pytest.mark.skipif(framing.COMPILED is None,
                              reason="framing's compiled half is not built here")


def test_the_compiled_half_is_built_and_used_where_a_compiler_is():
    headers = os.path.join(sysconfig.get_paths()["include"], "Python.h")
    if not (os.path.exists(headers) and any(
            os.access(os.path.join(d, "cc"), os.X_OK) for d in os.get_exec_path())):
        pytest.skip("no C compiler or no Python headers: the pure-Python path alone")
    assert framing.COMPILED is not None
    assert framing.Channel(SECRET).wire is not None


def test_the_environment_variable_turns_it_off():
    code = ("from reactor_dist.wire import framing; "
            "print(framing.COMPILED is None, framing.Channel(bytes(32)).wire is None)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, PURE_PYTHON_ENV: "1"}, check=True).stdout
    assert out.split() == ["True", "True"]


@compiled
def test_the_mac_is_hashlibs_keyed_blake2b_at_every_length():
    for length in [*range(0, 300), 1000, 4096, 70000]:
        key = hashlib.sha256(str(length).encode()).digest()
        data = bytes((i * 7 + length) & 0xFF for i in range(length))
        want = hashlib.blake2b(data, digest_size=32, key=key, person=MAC_ONE_FRAME).digest()
        wire = framing.Channel(key).wire
        assert wire.mac(data) == want, length
        assert wire.sign(data) == want + data


def hot(kind: str, flags: int = 0, value: int = 0, rank: int = 0, seq: int = 1,
        compute: float = 0.0, wait: float = 0.0, count: int = 0, version: int = WIRE_VERSION,
        tail: bytes = b"") -> bytes:
    return HOT_HEAD.pack(version, KIND_CODES[kind], flags, value, rank, seq, compute, wait,
                         count) + tail


def signed(head: bytes, secret: bytes = SECRET) -> list[bytes]:
    return [hashlib.blake2b(head, digest_size=32, key=secret, person=MAC_ONE_FRAME).digest()
            + head]


ACK = Hot.COMPUTE | Hot.WAIT
CHANNEL = framing.Channel(SECRET)
# (what, frames): every shape a reply socket may see, authentic or not
REPLIES = [
    ("an acknowledgement", signed(hot(Kind.REPLY, ACK, Hot.OK, 1, 1, 0.25, 0.5))),
    ("rank 0's small result", signed(hot(Kind.REPLY, ACK | Hot.EMBEDDED, Hot.OK, 0, 1, 0.1,
                                         tail=pickle.dumps("result")))),
    ("a logged acknowledgement", signed(hot(Kind.REPLY, ACK | Hot.LOGGED, Hot.OK, 1))),
    ("an acknowledgement of another call", signed(hot(Kind.REPLY, ACK, Hot.OK, 1, seq=7))),
    ("a rank out of range", signed(hot(Kind.REPLY, ACK, Hot.OK, rank=5))),
    ("a negative rank", signed(hot(Kind.REPLY, ACK, Hot.OK, rank=-1))),
    ("a raised reply", CHANNEL.pack({Field.KIND: Kind.REPLY, Field.SEQ: 1, Field.RANK: 1,
                                     Field.STATUS: Status.RAISED,
                                     Field.ERROR: ["ValueError", "no", "tb"]}, [b"x"])),
    ("a reply with items", signed(hot(Kind.REPLY, Hot.COUNT, Hot.OK, 0, count=3))),
    ("a stream's item", signed(hot(Kind.ITEM, Hot.COUNT | Hot.EMBEDDED, count=4,
                                   tail=pickle.dumps(4)))),
    ("an item with nothing", signed(hot(Kind.ITEM, Hot.COUNT, count=0))),
    ("a multipart reply", CHANNEL.pack({Field.KIND: Kind.REPLY, Field.SEQ: 1, Field.RANK: 0,
                                        Field.STATUS: Status.OK},
                                       [b"p" * 5000, b"q" * 70000])),
    ("a big first frame", signed(hot(Kind.REPLY, Hot.EXTRAS, Hot.OK, 0,
                                     tail=len(packed := msgpack.packb({"x": "y" * 70000}))
                                     .to_bytes(4, "little") + packed))),
    ("a death notice", CHANNEL.pack({Field.KIND: Kind.DEATH, Field.SEQ: 0, Field.RANK: 1,
                                     Field.EPOCH: 0})),
    ("a command (a replay)", signed(hot(Kind.CALL, 0, 1, -1, 3))),
    ("a forged acknowledgement", signed(hot(Kind.REPLY, ACK, Hot.OK, 1), bytes(32))),
    ("a forged item", signed(hot(Kind.ITEM, Hot.COUNT, count=1), bytes(32))),
    ("another wire version", signed(hot(Kind.REPLY, ACK, Hot.OK, 1, version=9))),
    ("a first-format message", signed(msgpack.packb({"kind": "reply"}))),
    ("an unknown kind code", signed(PREFIX.pack(WIRE_VERSION, 250) + b"\0" * 40)),
    ("an unknown status code", signed(hot(Kind.REPLY, ACK, 9, 1))),
    ("unknown flags", signed(hot(Kind.REPLY, 0x04, Hot.OK, 1))),
    ("a truncated header", signed(hot(Kind.REPLY, ACK, Hot.OK, 1)[:20])),
    ("an acknowledgement with a byte too many", signed(hot(Kind.REPLY, ACK, Hot.OK, 1,
                                                           tail=b"\0"))),
    ("a bare MAC", [b"\0" * 32]),
    ("an empty frame", [b""]),
    ("garbage", [os.urandom(100)]),
    ("a forged multipart", [b"\0" * 40, b"body"]),
]


def normal(message: tuple | None) -> object:
    """A gathered message, its big frames' bytes read (a view compares by content)."""
    if message is None or len(message) != 2:
        return message
    header, body = message
    return header, [bytes(frame) for frame in body]


@pytest.fixture
def bus(tmp_path):
    ipc = tmp_path / "ipc"
    ipc.mkdir()
    bus = bus_module.Bus(SECRET, str(ipc), world_size=2)
    push = bus.ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(bus.reply_addr)
    bus.push = push
    yield bus
    push.close(linger=0)
    bus.close()


def gathered(bus, frames: list[bytes], pure: bool, owed: int = 1) -> tuple[list, int]:
    wire = bus.wire
    if pure:
        bus.wire = None
    try:
        rejected = bus.rejections
        framing.send(bus.push.send, frames)
        return [normal(m) for m in bus.gather(1, owed, 2000, None)], bus.rejections - rejected
    finally:
        bus.wire = wire


@compiled
@pytest.mark.parametrize("what,frames", REPLIES, ids=[what for what, _ in REPLIES])
def test_a_call_queue_pass_gets_the_same_from_both_paths(bus, what, frames):
    compiled_answer = gathered(bus, frames, pure=False)
    pure_answer = gathered(bus, frames, pure=True)
    assert compiled_answer == pure_answer
    arrived, rejected = compiled_answer
    if what.startswith(("a forged", "another", "a first-format", "an unknown", "unknown",
                        "a truncated", "a bare", "an empty", "garbage", "a byte")) or \
            "too many" in what:
        assert arrived == [] and rejected == 1
    elif what in ("a rank out of range", "a negative rank", "a command (a replay)"):
        assert arrived == [] and rejected == 0


@compiled
def test_a_pass_takes_one_calls_acknowledgements_and_stops_at_anything_else(bus):
    def ack(rank: int, seq: int = 1) -> list[bytes]:
        return signed(hot(Kind.REPLY, ACK, Hot.OK, rank, seq, 0.5 + rank))

    for pure in (False, True):
        wire = bus.wire
        bus.wire = None if pure else wire
        try:
            for frames in (ack(0), ack(1), ack(0, seq=2), ack(1, seq=2)):
                framing.send(bus.push.send, frames)
            time.sleep(0.2)  # all four have arrived: one pass takes call 1's two
            first = bus.gather(1, 2, 2000, None)
            assert [(m[4], m[5], m[6]) for m in first] == [(0, 1, 0.5), (1, 1, 1.5)]
            # an acknowledgement of another call ends the pass, taken with it
            second = bus.gather(1, 2, 2000, None)
            assert [(m[4], m[5]) for m in second] == [(0, 2)]
            assert [(m[4], m[5]) for m in bus.gather(2, 1, 2000, None)] == [(1, 2)]
            assert bus.gather(2, 1, 0, None) == []  # nothing there: no wait
            began = time.monotonic()
            assert bus.gather(2, 1, 50, None) == []  # nothing came within 50 ms
            assert time.monotonic() - began >= 0.04  # wall-clock: it did wait
            # an ``until`` nearer than the wait: the pass goes on with the rest of it
            framing.send(bus.push.send, ack(0, seq=3))
            framing.send(bus.push.send, ack(1, seq=3))
            time.sleep(0.1)
            got = bus.gather(3, 2, 5000, time.monotonic() + 0.001)
            assert [(m[4], m[5]) for m in got] == [(0, 3), (1, 3)]
        finally:
            bus.wire = wire


@compiled
def test_a_closed_reply_socket_fails_as_pyzmqs_does(tmp_path):
    ipc = tmp_path / "ipc"
    ipc.mkdir()
    bus = bus_module.Bus(SECRET, str(ipc), world_size=1)
    wire, handle = bus.wire, bus.pull_handle
    bus.close()
    with pytest.raises(zmq.ZMQError) as failed:
        wire.gather(bus.pull_handle, 1, 1, 1, 0, 0, -1.0)
    assert failed.value.errno == zmq.ENOTSOCK
    assert handle != 0 and bus.pull_handle == 0


@compiled
def test_a_message_over_the_bound_is_read_to_its_end_and_refused(bus):
    small = framing.compiled_wire(SECRET, max_message=10000)
    framing.send(bus.push.send, [b"a" * 100, b"b" * 20000, b"c" * 10])
    framing.send(bus.push.send, signed(hot(Kind.REPLY, ACK, Hot.OK, 1)))
    with pytest.raises(framing.ProtocolError, match="over the bound"):
        small.receive(bus.pull_handle, 0)
    got, rest, retime = small.gather(bus.pull_handle, 1, 1, 2, 0, 2000, -1.0)
    assert [m[4] for m in got] == [1] and rest is None  # the next message is whole


COMMANDS = [
    ("a generate call", signed(hot(Kind.CALL, Hot.EMBEDDED, 1, -1, 5, tail=pickle.dumps(3)))),
    ("a reset", signed(hot(Kind.CALL, 0, 2, -1, 6))),
    ("a call behind calls in flight", signed(hot(Kind.CALL, 1, 1, -1, 7))),
    ("an embedded empty payload", signed(hot(Kind.CALL, Hot.EMBEDDED, 1, -1, 8))),
    ("a call with a digest", CHANNEL.pack({Field.KIND: Kind.CALL, Field.SEQ: 9, Field.RANK: -1,
                                           Field.METHOD: Method.GENERATE,
                                           Field.DIGEST: True})),
    ("a named method", CHANNEL.pack({Field.KIND: Kind.CALL, Field.SEQ: 10, Field.RANK: -1,
                                     Field.METHOD: "warm_up"}, [b"x" * 5000])),
    ("an unknown method code", signed(hot(Kind.CALL, 0, 77, -1, 11))),
    ("a call with bytes after its end", signed(hot(Kind.CALL, 0, 1, -1, 12, tail=b"z"))),
    ("ANSWERED", CHANNEL.pack({Field.KIND: Kind.ANSWERED, Field.SEQ: 3, Field.RANK: -1})),
    ("a release", CHANNEL.pack({Field.KIND: Kind.RELEASE, Field.SEQ: 0, Field.RANK: -1,
                                Field.RELEASED: ["rdist.x"]})),
    ("an item", signed(hot(Kind.ITEM, Hot.COUNT | Hot.EMBEDDED, count=2, tail=b"i"))),
    ("a forged call", signed(hot(Kind.CALL, 0, 1, -1, 13), bytes(32))),
    ("a call of another version", signed(hot(Kind.CALL, 0, 1, -1, 14, version=3))),
    ("a truncated call", signed(hot(Kind.CALL, 0, 1, -1, 15)[:30])),
    ("garbage", [os.urandom(80)]),
]


@compiled
@pytest.mark.parametrize("what,frames", COMMANDS, ids=[what for what, _ in COMMANDS])
def test_a_rank_decodes_each_command_as_the_pure_path_does(what, frames):
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    try:
        pull.bind("inproc://commands")
        push.connect("inproc://commands")
        answers = []
        for pure in (False, True):
            channel = framing.Channel(SECRET)
            if pure:
                channel.wire = None
            framing.send(push.send, frames)
            try:
                header, body = channel.command(pull, pull.underlying)
                answers.append((header, [bytes(f) for f in body]))
            except framing.ProtocolError as exc:
                answers.append(("refused", str(exc)))
        assert answers[0] == answers[1]
        if what.startswith(("a forged", "a call of another", "a truncated", "garbage",
                            "a call with bytes", "an unknown")):
            assert answers[0][0] == "refused"
        else:
            assert answers[0][0][Field.KIND] in (Kind.CALL, Kind.ANSWERED, Kind.RELEASE,
                                                 Kind.ITEM)
    finally:
        pull.close(linger=0)
        push.close(linger=0)
        ctx.term()


plain_like = st.fixed_dictionaries(
    {Field.KIND: st.sampled_from([Kind.CALL, Kind.REPLY, Kind.ITEM, Kind.PONG, "call"]),
     Field.SEQ: st.integers(-2, 2 ** 64) | st.booleans() | st.just(1.0),
     Field.RANK: st.integers(-2 ** 31 - 1, 2 ** 31) | st.booleans()},
    optional={Field.METHOD: st.sampled_from([Method.GENERATE, Method.RESET, Method.SNAPSHOT,
                                             Method.RESTORE, "warm_up", ""]) | st.just([]),
              Field.BEHIND: st.sampled_from([True, False, 1, None]),
              Field.STATUS: st.sampled_from([Status.OK, Status.RAISED, "ok", 1]),
              Field.COMPUTE: st.floats(allow_nan=False) | st.integers(0, 3),
              Field.COLLECTIVE_WAIT: st.floats(allow_nan=False) | st.just(None),
              Field.INDEX: st.integers(-1, 2 ** 32) | st.just(2.0),
              Field.ERROR: st.just(["E", "m", "t"])})


@compiled
@settings(max_examples=600, deadline=None, derandomize=True)
@given(plain_like, st.lists(st.binary(max_size=40) | st.binary(min_size=4097, max_size=4097),
                            max_size=2))
def test_a_message_packs_to_the_same_bytes_on_both_paths(header, body):
    pure = framing.Channel(SECRET)
    pure.wire = None
    answers = []
    for channel in (CHANNEL, pure):
        try:
            answers.append(channel.pack(dict(header), list(body)))
        except Exception as exc:  # the same refusal, of the same type
            answers.append((type(exc), str(exc)))
    assert answers[0] == answers[1]


@compiled
@pytest.mark.parametrize("header,embedded", [
    ({Field.KIND: Kind.CALL, Field.SEQ: 4, Field.RANK: -1, Field.METHOD: Method.GENERATE},
     b"input"),
    ({Field.KIND: Kind.CALL, Field.SEQ: 4, Field.RANK: -1, Field.METHOD: Method.RESET,
      Field.BEHIND: True}, None),
    ({Field.KIND: Kind.REPLY, Field.SEQ: 4, Field.RANK: 1, Field.STATUS: Status.OK,
      Field.COMPUTE: 0.5}, None),
    ({Field.KIND: Kind.REPLY, Field.SEQ: 4, Field.RANK: 0, Field.STATUS: Status.OK,
      Field.COMPUTE: 0.5, Field.COLLECTIVE_WAIT: 0.25}, b"result"),
    ({Field.KIND: Kind.ITEM, Field.SEQ: 4, Field.RANK: 0, Field.INDEX: 7}, b"item"),
])
def test_the_commonest_messages_pack_in_one_compiled_step(header, embedded):
    frame = CHANNEL.wire.pack_plain(dict(header), embedded)
    assert frame is not None
    assert frame == signed(CHANNEL.general_head(dict(header), embedded))[0]
    assert CHANNEL.unpack([frame]) == (header, [] if embedded is None else [embedded])


def test_make_compiled_here_builds_it_offline_or_says_why_not(tmp_path):
    """The GPU machine's way (make gpu-check-here): the C compiler alone, no pip."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    (tmp_path / "reactor_dist" / "wire").mkdir(parents=True)
    for name in ("Makefile", "reactor_dist/wire/_framing.c"):
        (tmp_path / name).write_bytes(open(os.path.join(root, name), "rb").read())
    make = ["make", "--no-print-directory", "-C", str(tmp_path), "compiled-here",
            f"PYTHON={sys.executable}"]
    failed = subprocess.run([*make, "CC=/nonexistent/cc"], capture_output=True, text=True)
    assert failed.returncode == 0
    assert "framing's compiled half: not built (no C compiler or no Python headers" in \
        failed.stdout
    if framing.COMPILED is None:
        pytest.skip("no compiler here: the build itself is not tried")
    built = subprocess.run(make, capture_output=True, text=True, check=True)
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    assert f"framing's compiled half: built, reactor_dist/wire/_framing{suffix}" in built.stdout
    code = ("import importlib.util as u; s = u.spec_from_file_location('_framing', "
            f"{str(tmp_path / 'reactor_dist' / 'wire' / ('_framing' + suffix))!r}); "
            "m = u.module_from_spec(s); s.loader.exec_module(m); print(m.HOT_FORMAT)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == HOT_HEAD.format
