"""Message framing and authentication on the runner's sockets (DESIGN.md sections 5, 7).

A message is a ZeroMQ multipart::

    [ mac + header | body frames ... ]

The first frame is the 32-byte MAC followed by the header, a msgpack map (kind,
sequence number, rank, status, buffer descriptors, ...); the body frames are the
pickle-5 stream and any small out-of-band buffers.  The MAC is HMAC-SHA256 under
the per-runner secret over the length-prefixed header and body frames; it shares
the header's frame because on a PUB socket every frame costs.  :func:`unpack`
checks the MAC before it even decodes the header, so nothing a stranger sends is
ever parsed, let alone unpickled.  Every malformed message raises :class:`ProtocolError`.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import msgpack

MAC_SIZE = 32
SECRET_SIZE = 32

# Commands: runner -> every rank (PUB).
PING = "ping"          # handshake probe, repeated until every rank answered
INIT = "init"          # form the process group, then load()
CALL = "call"          # generate / reset
SHUTDOWN = "shutdown"  # leave the serve loop and exit
COMMANDS = frozenset({PING, INIT, CALL, SHUTDOWN})

# Replies: one rank -> runner (PUSH).
PONG = "pong"          # handshake answer: pid, and rank 0's rendezvous port
READY = "ready"        # load() finished (status ok) or raised (status raised)
REPLY = "reply"        # outcome of one CALL
REPLIES = frozenset({PONG, READY, REPLY})

# Reply statuses.
OK = "ok"                        # the method returned
RAISED = "raised"                # the method (or decoding its input) raised
UNDELIVERABLE = "undeliverable"  # rank 0 returned, but its result could not be sent

KINDS = COMMANDS | REPLIES


class ProtocolError(Exception):
    """A message that is not ours: bad MAC, bad framing or a malformed header."""


@lru_cache(maxsize=16)
def _keyed(secret: bytes) -> Any:
    """HMAC state after the key: copying it is cheaper than keying anew per message."""
    return hmac.new(secret, digestmod=hashlib.sha256)


def _mac(secret: bytes, frames: Sequence[Any]) -> bytes:
    digest = _keyed(secret).copy()
    for frame in frames:
        size = len(frame) if type(frame) is bytes else memoryview(frame).nbytes
        digest.update(size.to_bytes(8, "little"))
        digest.update(frame)
    return digest.digest()


def pack(secret: bytes, header: dict[str, Any], body: Sequence[Any] = ()) -> list[Any]:
    """The multipart frames of one authenticated message."""
    head = msgpack.packb(header, use_bin_type=True)
    return [_mac(secret, [head, *body]) + head, *body]


def unpack(secret: bytes, parts: Sequence[Any]) -> tuple[dict[str, Any], list[Any]]:
    """Verify and decode one message: ``(header, body frames)``, else ProtocolError."""
    if len(parts) < 1:
        raise ProtocolError("empty message")
    first = parts[0] if type(parts[0]) is bytes else bytes(memoryview(parts[0]))
    if len(first) <= MAC_SIZE:
        raise ProtocolError(f"first frame has {len(first)} bytes: no room for MAC and header")
    frames = [first[MAC_SIZE:], *parts[1:]]
    if not hmac.compare_digest(first[:MAC_SIZE], _mac(secret, frames)):
        raise ProtocolError("MAC mismatch: message not signed with this runner's secret")
    try:
        header = msgpack.unpackb(frames[0], raw=False, strict_map_key=True)
    except Exception as exc:  # only reachable with a valid MAC, i.e. our own bug
        raise ProtocolError(f"undecodable header: {exc}") from None
    if type(header) is not dict:
        raise ProtocolError(f"header is {type(header).__name__}, expected a map")
    kind, seq, rank = header.get("k"), header.get("s"), header.get("r")
    if type(seq) is not int or type(rank) is not int:
        raise ProtocolError(f"header fields 's'/'r' are {seq!r}/{rank!r}, expected ints")
    if type(kind) is not str or kind not in KINDS:
        raise ProtocolError(f"unknown message kind {kind!r}")
    return header, frames[1:]
