"""Message framing and authentication on the runner's sockets.

A message is a ZeroMQ multipart::

    [ mac + header | body frames ... ]

The first frame is the 32-byte MAC followed by the header, a msgpack map whose
fields and kinds :mod:`reactor_dist.wire.protocol` names; the body frames are the
pickle-5 stream and any small out-of-band buffers.  A small pickle stream (most
calls and replies) rides inside the header as ``Field.EMBEDDED``, so that the common
message is one frame.

The MAC is keyed BLAKE2b-256 under the per-runner secret: over the header frame
alone for a one-frame message, else over every frame, length-prefixed, with a
different personalization so the two forms can never be confused.  (BLAKE2 is a
MAC when keyed; unlike HMAC-SHA256 through OpenSSL it is one small C call, and
on a 2-core machine the four MACs of an empty call cost 25 us the other way.)
:meth:`Channel.unpack` checks the MAC before it even decodes the header, so nothing a
stranger sends is ever parsed, let alone unpickled.  Every malformed message
raises :class:`ProtocolError`.

The header is short on purpose: empty fields are left out, and readers use
``header.get``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from hashlib import blake2b as _blake2b
from hmac import compare_digest
from typing import Any

import msgpack
import zmq

from .protocol import (
    EMBED_LIMIT,
    MAC_FRAMES,
    MAC_ONE_FRAME,
    MAC_SIZE,
    MAX_FRAME_DEFAULT,
    MAX_FRAME_ENV,
    MAX_MESSAGE_DEFAULT,
    MAX_MESSAGE_ENV,
    SECRET_SIZE,
    Field,
    Kind,
)

__all__ = ["MAC_SIZE", "SECRET_SIZE", "EMBED_LIMIT", "Channel", "ProtocolError", "send",
           "direct_send", "MAX_FRAME", "MAX_MESSAGE", "bounded"]

_SNDMORE = int(zmq.SNDMORE)
MAX_FRAME = int(os.environ.get(MAX_FRAME_ENV) or MAX_FRAME_DEFAULT)
MAX_MESSAGE = int(os.environ.get(MAX_MESSAGE_ENV) or MAX_MESSAGE_DEFAULT)
COPY_LIMIT = 64 << 10  # received frames up to this size are copied into bytes (cheaper)


def bounded(sock: zmq.Socket) -> zmq.Socket:
    """``sock``, which from now on drops any peer that sends a frame over MAX_FRAME
    (before reading it: a stranger's huge frame costs no memory)."""
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME)
    return sock


class ProtocolError(Exception):
    """A message that is not ours: bad MAC, bad framing or a malformed header."""


class Channel:
    """Packs and checks messages under one secret.  The keyed MAC states and the msgpack
    Packer are built once, so a message costs a copy of a state, not a new key block
    and a new Packer.  Not thread-safe (the Packer): the runner uses its channel under
    its lock, a rank from its one serving loop, anyone else a channel of their own."""

    def __init__(self, secret: bytes) -> None:
        self._one_frame = _blake2b(digest_size=MAC_SIZE, key=secret, person=MAC_ONE_FRAME)
        self._frames = _blake2b(digest_size=MAC_SIZE, key=secret, person=MAC_FRAMES)
        self._pack = msgpack.Packer(use_bin_type=True).pack

    def mac(self, frames: Sequence[Any]) -> bytes:
        """The MAC of a message whose frames (the first one without its MAC) are ``frames``."""
        if len(frames) == 1 and type(frames[0]) is bytes:
            digest = self._one_frame.copy()
            digest.update(frames[0])
            return digest.digest()
        digest = self._frames.copy()
        for frame in frames:
            size = len(frame) if type(frame) is bytes else memoryview(frame).nbytes
            digest.update(size.to_bytes(8, "little"))
            digest.update(frame)
        return digest.digest()

    def pack(self, header: dict[str, Any], body: Sequence[Any] = ()) -> list[Any]:
        """The multipart frames of one authenticated message (``header`` gains
        ``Field.EMBEDDED`` when the first body frame is small enough to ride in it)."""
        if body and type(body[0]) is bytes and len(body[0]) <= EMBED_LIMIT:
            header[Field.EMBEDDED], body = body[0], body[1:]
        head = self._pack(header)
        if not body:
            digest = self._one_frame.copy()
            digest.update(head)
            return [digest.digest() + head]
        return [self.mac([head, *body]) + head, *body]

    def unpack(self, parts: Sequence[Any]) -> tuple[dict[str, Any], list[Any]]:
        """Verify and decode one message: ``(header, body frames)``, else ProtocolError."""
        if not parts:
            raise ProtocolError("empty message")
        first = parts[0] if type(parts[0]) is bytes else memoryview(parts[0])
        if len(first) <= MAC_SIZE:
            raise ProtocolError(f"first frame has {len(first)} bytes: no room for MAC and header")
        head = first[MAC_SIZE:]  # a view when ``first`` is one: copied only once authentic
        if len(parts) == 1:  # the common message, its MAC inline
            frames = [head]
            digest = self._one_frame.copy()
            digest.update(head)
            expected = digest.digest()
        else:
            frames = [head, *parts[1:]]
            expected = self.mac(frames)
        if not compare_digest(bytes(first[:MAC_SIZE]), expected):
            raise ProtocolError("MAC mismatch: message not signed with this runner's secret")
        try:
            header = msgpack.unpackb(head, raw=False, strict_map_key=True)
        except Exception as exc:  # only reachable with a valid MAC, i.e. our own bug
            raise ProtocolError(f"undecodable header: {exc}") from None
        if type(header) is not dict:
            raise ProtocolError(f"header is {type(header).__name__}, expected a map")
        kind, seq, rank = header.get(Field.KIND), header.get(Field.SEQ), header.get(Field.RANK)
        if type(seq) is not int or type(rank) is not int:
            raise ProtocolError(f"header fields SEQ/RANK are {seq!r}/{rank!r}, expected ints")
        if type(kind) is not str or kind not in Kind.ALL:
            raise ProtocolError(f"unknown message kind {kind!r}")
        if Field.EMBEDDED not in header:
            return header, frames[1:]
        embedded = header.pop(Field.EMBEDDED)
        if type(embedded) is not bytes:
            raise ProtocolError(
                f"embedded body frame is {type(embedded).__name__}, expected bytes")
        frames[0] = embedded
        return header, frames

    def send(self, send_frame: Callable[..., Any], header: dict[str, Any],
             body: Sequence[Any] = ()) -> None:
        """Pack one message and send it with ``send_frame`` (a socket's ``send``, or
        :func:`direct_send` of it)."""
        send(send_frame, self.pack(header, body))

    def recv(self, sock: zmq.Socket) -> tuple[dict[str, Any], list[Any]]:
        """Receive and verify one whole message (blocking; zmq.Again after RCVTIMEO).

        Frames are taken as zmq.Frame, whose ``more`` flag is a plain attribute: asking
        the socket for RCVMORE goes through pyzmq's option enum, about 1 us a message.
        A frame over COPY_LIMIT stays a view of ZeroMQ's buffer: a stranger's big
        forged frame is never copied, and an authentic big body is copied no more.
        A message over MAX_MESSAGE in all is let go frame by frame as it comes."""
        frame = sock.recv(copy=False)
        size = len(frame)
        parts: list[Any] | None = [frame.bytes if size <= COPY_LIMIT else frame.buffer]
        while frame.more:
            frame = sock.recv(copy=False)
            size += len(frame)
            if size > MAX_MESSAGE:
                parts = None  # keep reading to its end, holding nothing
            elif parts is not None:
                parts.append(frame.bytes if len(frame) <= COPY_LIMIT else frame.buffer)
        if parts is None:
            raise ProtocolError(f"a message of {size >> 20} MiB, over the bound of "
                                f"{MAX_MESSAGE >> 20} MiB ({MAX_MESSAGE_ENV})")
        return self.unpack(parts)


def send(send_frame: Callable[..., Any], frames: Sequence[Any]) -> None:
    """Send one multipart message frame by frame: pyzmq's ``send_multipart`` costs
    microseconds of Python per message on the per-call path."""
    if len(frames) > 1:
        for frame in frames[:-1]:
            send_frame(frame, _SNDMORE)
    send_frame(frames[-1])


def direct_send(sock: zmq.Socket) -> Callable[..., Any]:
    """``sock.send`` without pyzmq's Python layer over it (which only adds the draft
    sockets' routing options): bound once, it saves a Python call per message."""
    return super(zmq.Socket, sock).send if isinstance(sock, zmq.Socket) else sock.send
