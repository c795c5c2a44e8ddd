"""The protocol's own floor: our wire in straight-line Python, with no bookkeeping.

Between the bare bus (``raw_floor.RawFloor``) and the runner sits what our messages
cost before any of the runner's bookkeeping: the keyed BLAKE2b MAC of each message, the
fixed binary header (``protocol.HOT_HEAD``) packed and unpacked, the input and the
result pickled.  These peers speak exactly that, a call's frame byte for byte what
``framing.Channel`` packs (``tests/test_bench_quick.py`` checks it), in the fewest
Python steps: a peer receives, checks the MAC, unpacks the header, unpickles the input,
times the call, and sends rank 0's pickled result or every other rank's
acknowledgement; the caller publishes and counts the replies by sequence number.  No
deadlines, no ledgers, no restarts, no error contract: what the runner could reach if
its bookkeeping cost nothing, so ``ours ÷ this`` is the bookkeeping's share and ``this
÷ the bus`` the protocol's share of the time in Python.

``ProtocolFloor(n, mac=False)`` sends the same bytes with the MAC zeroed and unchecked:
what the MAC costs.  ``python -m benchmarks.implementations.protocol_floor PUB_ADDR
PULL_ADDR RANK KEY`` is one peer (KEY: the MAC's secret, hex; empty: no MAC).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
from hashlib import blake2b
from hmac import compare_digest

import zmq

from benchmarks.implementations.procs import child_env
from benchmarks.implementations.raw_floor import OWN_GROUP, RawFloor
from reactor_dist.wire.protocol import (
    ACK_SIZE,
    HOT_HEAD,
    KIND_CODES,
    MAC_ONE_FRAME,
    MAC_SIZE,
    SECRET_SIZE,
    WIRE_VERSION,
    Field,
    Hot,
    Kind,
    Method,
)

CALL, REPLY, ITEM = KIND_CODES[Kind.CALL], KIND_CODES[Kind.REPLY], KIND_CODES[Kind.ITEM]
GENERATE, STOP = (Hot.CODES[Field.METHOD][Method.GENERATE],
                  Hot.CODES[Field.METHOD][Method.RESET])
_pack, _unpack = HOT_HEAD.pack, HOT_HEAD.unpack_from


class Signer:
    """The MAC of a one-frame message as ``framing.Channel`` makes and checks it."""

    def __init__(self, key: bytes) -> None:
        self.state = blake2b(digest_size=MAC_SIZE, key=key, person=MAC_ONE_FRAME)

    def sign(self, head: bytes) -> bytes:
        digest = self.state.copy()
        digest.update(head)
        return digest.digest() + head

    def check(self, frame: bytes) -> None:
        digest = self.state.copy()
        digest.update(frame[MAC_SIZE:])
        if not compare_digest(frame[:MAC_SIZE], digest.digest()):
            raise RuntimeError("protocol floor: MAC mismatch")


class Unsigned(Signer):
    """The same frames with the MAC's bytes left zero and never checked: what the MAC
    itself costs, measured (no runner runs without it)."""

    def __init__(self, key: bytes) -> None:
        pass

    def sign(self, head: bytes) -> bytes:
        return bytes(MAC_SIZE) + head

    def check(self, frame: bytes) -> None:
        pass


def call_frame(signer: Signer, seq: int, value: object, method: int = GENERATE) -> bytes:
    """A plain CALL of ``value`` (embedded), as ``framing.Channel.pack`` frames it."""
    return signer.sign(_pack(WIRE_VERSION, CALL, Hot.EMBEDDED, method, -1, seq, 0.0, 0.0, 0)
                       + pickle.dumps(value))


def peer(pub_addr: str, pull_addr: str, rank: int, key: bytes) -> None:
    """One rank: ``generate(value)`` returns ``value``; ``generate(("items", n))``: rank 0
    sends n ITEMs first (a stream's step); a RESET call ends the peer."""
    signer = Signer(key) if key else Unsigned(key)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub_addr)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(pull_addr)
    recv, send, sign, check, clock = sub.recv, push.send, signer.sign, signer.check, \
        time.perf_counter
    while True:
        frame = recv()
        check(frame)
        _, kind, flags, method, _, seq, _, _, _ = _unpack(frame, MAC_SIZE)
        if kind != CALL:  # the caller's handshake
            send(sign(_pack(WIRE_VERSION, REPLY, 0, Hot.OK, rank, seq, 0.0, 0.0, 0)))
            continue
        if method == STOP:
            break
        value = pickle.loads(frame[ACK_SIZE:])
        began = clock()
        result = value
        if type(value) is tuple:  # ("items", n): a stream's step
            result = None
            for index in range(value[1] if rank == 0 else 0):
                send(sign(_pack(WIRE_VERSION, ITEM, Hot.COUNT | Hot.EMBEDDED, 0, rank, seq,
                                0.0, 0.0, index) + pickle.dumps(index)))
        compute = clock() - began
        if rank == 0:
            send(sign(_pack(WIRE_VERSION, REPLY, Hot.COMPUTE | Hot.EMBEDDED, Hot.OK, rank, seq,
                            compute, 0.0, 0) + pickle.dumps(result)))
        else:
            send(sign(_pack(WIRE_VERSION, REPLY, Hot.COMPUTE, Hot.OK, rank, seq, compute,
                            0.0, 0)))
    sub.close(0)
    push.close(0)
    ctx.term()


class ProtocolFloor(RawFloor):
    """The caller's side, with a pool's ``generate`` and the bus's ``pipelined`` and
    ``stream``, so that all three are timed alike; bound and closed as the bus is."""

    name = "protocol floor"

    def __init__(self, world_size: int, mac: bool = True) -> None:
        self.world_size = world_size
        self.key = os.urandom(SECRET_SIZE) if mac else b""
        self.signer = Signer(self.key) if mac else Unsigned(self.key)
        self.seq = 0
        self.owed: dict[int, int] = {}  # replies still to come, by call (in flight)
        pub_addr, pull_addr = self.bind("proto")
        self.procs = [
            subprocess.Popen([sys.executable, "-m", "benchmarks.implementations.protocol_floor",
                              pub_addr, pull_addr, str(r), self.key.hex()], env=child_env(),
                             **OWN_GROUP)
            for r in range(world_size)]
        try:
            self._handshake()
        except BaseException:
            self.close()
            raise

    def _handshake(self) -> None:
        """Ping (a header of another kind, answered by every peer) until every peer
        answered one ping: PUB drops what a slow joiner missed; stale answers are read
        past by their sequence number."""
        deadline = time.monotonic() + 30
        while True:
            if time.monotonic() > deadline:
                raise RuntimeError("protocol floor peers did not connect")
            self.seq += 1
            ping = self.seq
            self.pub.send(self.signer.sign(_pack(WIRE_VERSION, 0, 0, 0, -1, ping, 0.0, 0.0, 0)))
            answered = set()
            while self.pull.poll(50):
                frame = self.pull.recv()
                fields = _unpack(frame, MAC_SIZE)
                if fields[5] == ping:
                    answered.add(fields[4])
            if len(answered) == self.world_size:
                return

    def publish(self, value: object, method: int = GENERATE) -> int:
        self.seq += 1
        self.owed[self.seq] = self.world_size
        self.pub.send(call_frame(self.signer, self.seq, value, method))
        return self.seq

    def take(self, seq: int) -> object:
        """Until every rank answered call ``seq`` (replies to later calls are counted as
        they come); rank 0's result.  Items are read past (see :meth:`stream`)."""
        recv, check, owed = self.pull.recv, self.signer.check, self.owed
        compute: dict[int, float] = {}
        result = None
        while owed[seq]:
            frame = recv()
            check(frame)
            _, kind, flags, status, rank, of, took, _, _ = _unpack(frame, MAC_SIZE)
            if kind != REPLY:
                pickle.loads(frame[ACK_SIZE:])  # an item: handed over, as a stream does
                continue
            owed[of] -= 1
            compute[rank] = took
            if rank == 0 and of == seq:
                result = pickle.loads(frame[ACK_SIZE:])
        del owed[seq]
        return result

    def generate(self, value: object = 1) -> object:
        return self.take(self.publish(value))

    def pipelined(self, calls: int, ahead: int) -> None:
        """``calls`` calls with ``ahead`` of them sent before the first is taken."""
        sent = [self.publish(1) for _ in range(min(ahead, calls))]
        for done in range(calls):
            self.take(sent.pop(0))
            if done + ahead < calls:
                sent.append(self.publish(1))

    def stream(self, items: int) -> object:
        """A stream's step: rank 0 sends ``items`` items, then every rank its reply."""
        return self.generate(("items", items))

    def close(self) -> None:
        if not self.ctx.closed:
            self.unbind(call_frame(self.signer, self.seq + 1, None, STOP))


if __name__ == "__main__":
    peer(sys.argv[1], sys.argv[2], int(sys.argv[3]), bytes.fromhex(sys.argv[4]))
