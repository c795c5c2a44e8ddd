"""One peer of the raw-pyzmq floor: SUB a ~100-byte header, PUSH a ~100-byte answer.

This is the least a PUB/SUB fan-out plus PUSH/PULL gather can cost with this many
processes on this machine; the runner's per-call overhead is read against it.
"""

from __future__ import annotations

import struct
import sys

import zmq

HEADER_BYTES = 100
CMD = struct.Struct("<Q")  # sequence number, padded to HEADER_BYTES
REPLY = struct.Struct("<QI")  # sequence number, rank, padded to HEADER_BYTES
STOP = 0xFFFFFFFFFFFFFFFF


def pad(b: bytes) -> bytes:
    return b + bytes(HEADER_BYTES - len(b))


def main() -> None:
    pub_addr, pull_addr, rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub_addr)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(pull_addr)
    while True:
        (seq,) = CMD.unpack_from(sub.recv())
        if seq == STOP:
            break
        push.send(pad(REPLY.pack(seq, rank)))
    sub.close(0)
    push.close(0)
    ctx.term()


if __name__ == "__main__":
    main()
