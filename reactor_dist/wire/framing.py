"""Message framing and authentication on the runner's sockets.

A message is a ZeroMQ multipart::

    [ mac + header | body frames ... ]

The first frame is the 32-byte MAC followed by the header: the wire version and the
kind's code, then for the hot kinds (a call, its replies and items, ANSWERED) a fixed
binary part, the other fields as a msgpack map and a small first body frame; for the
other kinds a msgpack map (:mod:`reactor_dist.wire.protocol` lays both out: ``HOT_HEAD``,
``Hot``).  The body frames are the pickle-5 stream and any small out-of-band buffers.
A small pickle stream (most calls and replies) rides inside the header
(``Field.EMBEDDED``), so that the common message is one frame; a reply that holds
nothing but the fixed part is an acknowledgement, which :meth:`Channel.take` hands
over as the fixed part's fields, without a header map.

The MAC is keyed BLAKE2b-256 under the per-runner secret: over the header frame
alone for a one-frame message, else over every frame, length-prefixed, with a
different personalization so the two forms can never be confused.  (BLAKE2 is a
MAC when keyed; unlike HMAC-SHA256 through OpenSSL it is one small C call, and
on a 2-core machine the four MACs of an empty call cost 25 us the other way.)
:meth:`Channel.unpack` checks the MAC before it even decodes the header, so nothing a
stranger sends is ever parsed, let alone unpickled.  Every malformed message, and one
of another wire version, raises :class:`ProtocolError`.

Decoded, a header is a plain dict keyed by ``Field``'s constants; empty fields are
left out, and readers use ``header.get``.

The per-message path has a compiled half, ``_framing.c`` beside this file (:data:`COMPILED`):
a one-frame MAC, a caller's pass over one call's acknowledgements (``Wire.gather``) and
a rank's receipt of a plain command (``Wire.command``), each one C call with the GIL
released while it waits.  It is optional and speaks the same bytes: where it is not built,
or PURE_PYTHON_ENV is set, this module's own code does the same.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from hashlib import blake2b as _blake2b
from hmac import compare_digest
from typing import Any

import msgpack
import zmq

from .protocol import (
    ACK_SIZE,
    EMBED_LIMIT,
    EXTRAS_SIZE,
    HOT,
    HOT_HEAD,
    KIND_CODES,
    KINDS_BY_CODE,
    MAC_FRAMES,
    MAC_ONE_FRAME,
    MAC_SIZE,
    MAX_FRAME_DEFAULT,
    MAX_FRAME_ENV,
    MAX_MESSAGE_DEFAULT,
    MAX_MESSAGE_ENV,
    PREFIX,
    PURE_PYTHON_ENV,
    SECRET_SIZE,
    WIRE_VERSION,
    Field,
    Hot,
    Kind,
    Status,
)

__all__ = ["MAC_SIZE", "SECRET_SIZE", "EMBED_LIMIT", "Channel", "ProtocolError", "send",
           "direct_send", "MAX_FRAME", "MAX_MESSAGE", "bounded", "COMPILED"]

_SNDMORE = int(zmq.SNDMORE)
MAX_FRAME = int(os.environ.get(MAX_FRAME_ENV) or MAX_FRAME_DEFAULT)
MAX_MESSAGE = int(os.environ.get(MAX_MESSAGE_ENV) or MAX_MESSAGE_DEFAULT)
COPY_LIMIT = 64 << 10  # received frames up to this size are copied into bytes (cheaper)
_FIXED = (Field.KIND, Field.SEQ, Field.RANK)
_REPLY_CODE, _CALL_CODE, _ITEM_CODE = (KIND_CODES[Kind.REPLY], KIND_CODES[Kind.CALL],
                                       KIND_CODES[Kind.ITEM])
_METHOD_CODES = Hot.CODES[Field.METHOD]
# The flags of a reply Channel.take hands over undecoded (anything more is decoded whole).
_TAKEN_FLAGS = Hot.LOGGED | Hot.COMPUTE | Hot.WAIT | Hot.EMBEDDED
_SECONDS = ((Field.COMPUTE, Hot.COMPUTE), (Field.COLLECTIVE_WAIT, Hot.WAIT))  # HOT_HEAD's floats
_pack_hot, _unpack_hot = HOT_HEAD.pack, HOT_HEAD.unpack_from
_METHOD_NAMES = Hot.VALUES[Field.METHOD]
_BEHIND = Hot.BOOLEANS[Kind.CALL][Field.BEHIND]
_CODE_AT = MAC_SIZE + 1  # where the kind's code is in a first frame
# Every flag bit a hot kind may carry.
_KNOWN_FLAGS = {kind: sum(booleans.values()) | Hot.COUNT | Hot.COMPUTE | Hot.WAIT
                | Hot.EMBEDDED | Hot.EXTRAS for kind, booleans in Hot.BOOLEANS.items()}


def _loaded_libzmq() -> str | None:
    """The libzmq file pyzmq loaded into this process; None where pyzmq holds libzmq
    inside its own extension (a static build), which the compiled half cannot reach."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1]
                if os.path.basename(path).startswith("libzmq"):
                    return path
    except OSError:
        pass
    return None


def _compiled() -> Any:
    """framing's compiled half (``_framing.c``), bound to pyzmq's libzmq; None where it is
    not built, is turned off (PURE_PYTHON_ENV), or cannot reach libzmq or this layout."""
    if os.environ.get(PURE_PYTHON_ENV, "") not in ("", "0") or sys.byteorder != "little":
        return None
    try:
        from . import _framing  # type: ignore[attr-defined]
    except ImportError:
        return None
    path = _loaded_libzmq()
    if path is None or _framing.HOT_FORMAT != HOT_HEAD.format or _framing.MAC_SIZE != MAC_SIZE:
        return None
    try:
        _framing.bind(path)
    except OSError:
        return None
    return _framing


def _zmq_failed(errno: int) -> None:
    """Raise what pyzmq raises for libzmq's ``errno`` (the compiled half calls it)."""
    if errno == zmq.EAGAIN:
        raise zmq.Again(errno)
    if errno == zmq.ETERM:
        raise zmq.ContextTerminated(errno)
    raise zmq.ZMQError(errno)


def _too_big(size: int) -> None:
    raise ProtocolError(f"a message of {size >> 20} MiB, over the bound of "
                        f"{MAX_MESSAGE >> 20} MiB ({MAX_MESSAGE_ENV})")  # receive()'s words


def compiled_wire(secret: bytes, max_message: int | None = None) -> Any:
    """The compiled half's ``Wire`` under ``secret``, handed every constant of this wire
    that it uses (``max_message``: MAX_MESSAGE unless given); None where it is not built."""
    if COMPILED is None:
        return None
    ints = {"version": WIRE_VERSION, "call_code": _CALL_CODE, "reply_code": _REPLY_CODE,
            "item_code": _ITEM_CODE, "ok": Hot.OK, "taken_flags": _TAKEN_FLAGS,
            "embedded": Hot.EMBEDDED, "behind": _BEHIND, "count": Hot.COUNT,
            "compute": Hot.COMPUTE, "wait": Hot.WAIT, "copy_limit": COPY_LIMIT,
            "max_message": MAX_MESSAGE if max_message is None else max_message}
    objects = {"failed": _zmq_failed, "too_big": _too_big, "methods": _METHOD_NAMES,
               "method_codes": _METHOD_CODES, "k_kind": Field.KIND, "k_seq": Field.SEQ,
               "k_rank": Field.RANK, "k_method": Field.METHOD, "k_behind": Field.BEHIND,
               "k_index": Field.INDEX, "k_status": Field.STATUS, "k_compute": Field.COMPUTE,
               "k_wait": Field.COLLECTIVE_WAIT, "v_call": Kind.CALL, "v_item": Kind.ITEM,
               "v_reply": Kind.REPLY, "v_ok": Status.OK}
    return COMPILED.Wire(key=secret, person=MAC_ONE_FRAME, ints=ints, objects=objects)


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
        # The compiled half under this secret, or None (then the code below does it all).
        self.wire = compiled_wire(secret)
        if self.wire is not None:
            self._sign = self.wire.sign

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
        """The multipart frames of one authenticated message (the first body frame rides
        in the header when it is small enough)."""
        embedded = None
        if body and type(body[0]) is bytes and len(body[0]) <= EMBED_LIMIT:
            embedded, body = body[0], body[1:]
        if not body and self.wire is not None:
            frame = self.wire.pack_plain(header, embedded)  # the commonest, in one step
            if frame is not None:
                return [frame]
        head = self.head(header, embedded)
        if not body:
            return [self._sign(head)]
        return [self.mac([head, *body]) + head, *body]

    def _sign(self, head: bytes) -> bytes:
        """A one-frame message's frame: the MAC of ``head``, then it (an instance's
        compiled ``wire.sign`` stands in where there is one)."""
        digest = self._one_frame.copy()
        digest.update(head)
        return digest.digest() + head

    def head(self, header: dict[str, Any], embedded: bytes | None = None) -> bytes:
        """A header's bytes (without the MAC), as protocol.HOT_HEAD and Hot lay them out."""
        return _plain_head(header[Field.KIND], header, embedded) or \
            self.general_head(header, embedded)

    def general_head(self, header: dict[str, Any], embedded: bytes | None = None) -> bytes:
        """:meth:`head` of any header, field by field (the plain ones are packed straight)."""
        kind = header[Field.KIND]
        code = KIND_CODES.get(kind)
        if code is None:
            raise ValueError(f"reactor_dist bug: no message kind {kind!r}")
        rest = {k: v for k, v in header.items() if k != Field.KIND}
        if kind not in HOT:
            if embedded is not None:
                rest[Field.EMBEDDED] = embedded
            return PREFIX.pack(WIRE_VERSION, code) + self._pack(rest)
        seq, rank = rest.pop(Field.SEQ), rest.pop(Field.RANK)
        flags = value = count = 0
        for name, bit in Hot.BOOLEANS[kind].items():
            if rest.get(name) is True:
                del rest[name]
                flags |= bit
        coded = Hot.CODED.get(kind)
        if coded is not None and type(rest.get(coded)) is str:
            value = Hot.CODES[coded].get(rest[coded], 0)
            if value:
                del rest[coded]
        seconds = [0.0, 0.0]  # compute, collective wait
        for at, (name, bit) in enumerate(_SECONDS):
            if type(rest.get(name)) is float:
                seconds[at] = rest.pop(name)
                flags |= bit
        compute, wait = seconds
        counted = Hot.COUNTS.get(kind)
        if counted is not None and type(rest.get(counted)) is int and \
                0 <= rest[counted] < 1 << 32:
            count = rest.pop(counted)
            flags |= Hot.COUNT
        extras = b""
        if rest:
            extras = self._pack(rest)
            flags |= Hot.EXTRAS
        if embedded is not None:
            flags |= Hot.EMBEDDED
        head = HOT_HEAD.pack(WIRE_VERSION, code, flags, value, rank, seq, compute, wait, count)
        if extras:
            head += EXTRAS_SIZE.pack(len(extras)) + extras
        return head if embedded is None else head + embedded

    def unpack(self, parts: Sequence[Any]) -> tuple[dict[str, Any], list[Any]]:
        """Verify and decode one message: ``(header, body frames)``, else ProtocolError."""
        first, frames = self.verify(parts)
        if not frames and type(first) is bytes and len(first) >= ACK_SIZE and \
                (first[_CODE_AT] == _CALL_CODE or first[_CODE_AT] == _ITEM_CODE):
            plain = _plain_message(first)
            if plain is not None:
                return plain
        return self.decoded(first, frames)

    def verify(self, parts: Sequence[Any]) -> tuple[Any, list[Any]]:
        """The MAC checked: the first frame (bytes, or a view of a big one) and the body
        frames; else ProtocolError."""
        if not parts:
            raise ProtocolError("empty message")
        first = parts[0] if type(parts[0]) is bytes else memoryview(parts[0])
        if len(first) <= MAC_SIZE:
            raise ProtocolError(f"first frame has {len(first)} bytes: no room for MAC and header")
        if len(parts) == 1:  # the common message, its MAC inline
            digest = self._one_frame.copy()
            digest.update(first[MAC_SIZE:])  # a view when ``first`` is one
            expected = digest.digest()
        else:
            expected = self.mac([first[MAC_SIZE:], *parts[1:]])
        if not compare_digest(bytes(first[:MAC_SIZE]), expected):
            raise ProtocolError("MAC mismatch: message not signed with this runner's secret")
        return first, list(parts[1:])

    def take(self, parts: Sequence[Any]) -> tuple:
        """:meth:`unpack`, but a REPLY of status OK that holds nothing beyond
        protocol.HOT_HEAD but a small payload (every rank's acknowledgement, rank 0's small
        result) comes back as HOT_HEAD's nine fields and the payload (None for an
        acknowledgement): no header map, so that the caller counts it into its call."""
        if len(parts) == 1:
            first = parts[0]
            if type(first) is bytes and len(first) >= ACK_SIZE and \
                    first[_CODE_AT] == _REPLY_CODE:
                digest = self._one_frame.copy()
                digest.update(first[MAC_SIZE:])
                if not compare_digest(first[:MAC_SIZE], digest.digest()):
                    return self.unpack(parts)  # refused there, as every other message
                fields = HOT_HEAD.unpack_from(first, MAC_SIZE)
                flags = fields[2]
                if fields[0] == WIRE_VERSION and fields[3] == Hot.OK and \
                        not flags & ~_TAKEN_FLAGS:
                    if not flags & Hot.EMBEDDED:
                        if len(first) == ACK_SIZE:
                            return fields + (None,)
                    elif len(first) > ACK_SIZE:
                        return fields + (first[ACK_SIZE:],)
                return self.decoded(first, [])
        return self.unpack(parts)

    def decoded(self, first: Any, frames: list[Any]) -> tuple[dict[str, Any], list[Any]]:
        """A verified message's header decoded and checked: ``(header, body frames)``."""
        header = decode(first[MAC_SIZE:])
        kind, seq, rank = header.get(Field.KIND), header.get(Field.SEQ), header.get(Field.RANK)
        if type(seq) is not int or type(rank) is not int:
            raise ProtocolError(f"header fields SEQ/RANK are {seq!r}/{rank!r}, expected ints")
        if type(kind) is not str or kind not in Kind.ALL:
            raise ProtocolError(f"unknown message kind {kind!r}")
        if Field.EMBEDDED not in header:
            return header, frames
        embedded = header.pop(Field.EMBEDDED)
        if type(embedded) is not bytes:
            raise ProtocolError(
                f"embedded body frame is {type(embedded).__name__}, expected bytes")
        frames.insert(0, embedded)
        return header, frames

    def send(self, send_frame: Callable[..., Any], header: dict[str, Any],
             body: Sequence[Any] = ()) -> None:
        """Pack one message and send it with ``send_frame`` (a socket's ``send``, or
        :func:`direct_send` of it)."""
        send(send_frame, self.pack(header, body))

    def recv(self, sock: zmq.Socket) -> tuple[dict[str, Any], list[Any]]:
        """Receive, verify and decode one whole message (blocking; zmq.Again after
        RCVTIMEO)."""
        return self.unpack(receive(sock))

    def command(self, sock: zmq.Socket, handle: int) -> tuple[dict[str, Any], list[Any]]:
        """:meth:`recv` of a rank's commands, ``handle`` its ``sock.underlying``: a plain
        call or item decoded in one compiled step where there is one."""
        if self.wire is None:
            return self.unpack(receive(sock))
        message = self.wire.command(handle, 0)
        return message if type(message) is tuple else self.unpack(message)


def _plain_head(kind: str, header: dict[str, Any], embedded: bytes | None) -> bytes | None:
    """The header bytes of the commonest messages, packed straight (what
    :meth:`Channel.head`'s general path makes of them): a CALL of a built-in method with
    nothing else to say (KIND, METHOD, SEQ, RANK, maybe BEHIND), a REPLY of status OK
    that holds only its times (KIND, SEQ, RANK, STATUS, COMPUTE, maybe COLLECTIVE_WAIT;
    every rank's acknowledgement), and an ITEM with only its index (KIND, SEQ, RANK,
    INDEX).  None for any other header."""
    flags = 0 if embedded is None else Hot.EMBEDDED
    if kind == Kind.CALL:
        if len(header) == 5 and header.get(Field.BEHIND) is True:  # behind calls in flight
            flags |= _BEHIND
        elif len(header) != 4:
            return None
        method = header.get(Field.METHOD)
        value = _METHOD_CODES.get(method, 0) if type(method) is str else 0
        if not value:
            return None
        head = _pack_hot(WIRE_VERSION, _CALL_CODE, flags, value, header[Field.RANK],
                         header[Field.SEQ], 0.0, 0.0, 0)
    elif kind == Kind.REPLY:
        if not 5 <= len(header) <= 6 or header.get(Field.STATUS) != Status.OK:
            return None
        compute, wait = header.get(Field.COMPUTE), header.get(Field.COLLECTIVE_WAIT, 0.0)
        if type(compute) is not float or type(wait) is not float or \
                len(header) != 5 + (Field.COLLECTIVE_WAIT in header):
            return None
        if Field.COLLECTIVE_WAIT in header:
            flags |= Hot.WAIT
        head = _pack_hot(WIRE_VERSION, _REPLY_CODE, flags | Hot.COMPUTE, Hot.OK,
                         header[Field.RANK], header[Field.SEQ], compute, wait, 0)
    elif kind == Kind.ITEM:
        index = header.get(Field.INDEX)
        if len(header) != 4 or type(index) is not int or not 0 <= index < 1 << 32:
            return None
        head = _pack_hot(WIRE_VERSION, _ITEM_CODE, flags | Hot.COUNT, 0, header[Field.RANK],
                         header[Field.SEQ], 0.0, 0.0, index)
    else:
        return None
    return head if embedded is None else head + embedded


def _plain_message(first: bytes) -> tuple[dict[str, Any], list[Any]] | None:
    """A verified one-frame CALL or ITEM as :func:`_plain_head` packs it, decoded
    straight, as :meth:`Channel.decoded` would; None for any other (decoded in full)."""
    version, code, flags, value, rank, seq, _, _, count = _unpack_hot(first, MAC_SIZE)
    if version != WIRE_VERSION:
        return None
    if code == _CALL_CODE:
        method = _METHOD_NAMES.get(value)
        if method is None or flags & ~(Hot.EMBEDDED | _BEHIND):
            return None
        header = {Field.KIND: Kind.CALL, Field.SEQ: seq, Field.RANK: rank, Field.METHOD: method}
        if flags & _BEHIND:
            header[Field.BEHIND] = True
    else:  # an item (Channel.unpack asks for no other kind)
        if value or (flags & ~Hot.EMBEDDED) != Hot.COUNT:
            return None
        header = {Field.KIND: Kind.ITEM, Field.SEQ: seq, Field.RANK: rank, Field.INDEX: count}
    if flags & Hot.EMBEDDED:
        return header, [first[ACK_SIZE:]]
    return (header, []) if len(first) == ACK_SIZE else None


COMPILED = _compiled()  # framing's compiled half, bound; None: the pure-Python path alone


def decode(head: Any) -> dict[str, Any]:
    """An authentic header's bytes (after the MAC) as a header map; ProtocolError when
    they are not one of this wire version's."""
    if len(head) < PREFIX.size:
        raise ProtocolError(f"a header of {len(head)} bytes: no room for its version and kind")
    version, code = PREFIX.unpack_from(head)
    if version != WIRE_VERSION:
        raise ProtocolError(version_refused(version))
    kind = KINDS_BY_CODE.get(code)
    if kind is None:
        raise ProtocolError(f"unknown message kind code {code}")
    if kind not in HOT:
        header = unpack_map(head[PREFIX.size:], "header")
        if Field.KIND in header:
            raise ProtocolError("a header map that names its kind again")
        header[Field.KIND] = kind
        return header
    if len(head) < HOT_HEAD.size:
        raise ProtocolError(f"a {kind} header of {len(head)} bytes, shorter than its fixed "
                            f"part ({HOT_HEAD.size})")
    _, _, flags, value, rank, seq, compute, wait, count = HOT_HEAD.unpack_from(head)
    if flags & ~_KNOWN_FLAGS[kind]:
        raise ProtocolError(f"a {kind} header with unknown flags {flags:#04x}")
    header: dict[str, Any] = {Field.KIND: kind, Field.SEQ: seq, Field.RANK: rank}
    for name, bit in Hot.BOOLEANS[kind].items():
        if flags & bit:
            header[name] = True
    if value:
        coded = Hot.CODED.get(kind)
        named = None if coded is None else Hot.VALUES[coded].get(value)
        if named is None:
            raise ProtocolError(f"a {kind} header with an unknown code {value}")
        header[coded] = named  # type: ignore[index]
    if flags & Hot.COMPUTE:
        header[Field.COMPUTE] = compute
    if flags & Hot.WAIT:
        header[Field.COLLECTIVE_WAIT] = wait
    if flags & Hot.COUNT:
        counted = Hot.COUNTS.get(kind)
        if counted is None:
            raise ProtocolError(f"a {kind} header with a count")
        header[counted] = count
    at = HOT_HEAD.size
    if flags & Hot.EXTRAS:
        if len(head) < at + EXTRAS_SIZE.size:
            raise ProtocolError(f"a {kind} header cut short before its extras")
        (size,) = EXTRAS_SIZE.unpack_from(head, at)
        at += EXTRAS_SIZE.size
        if len(head) < at + size:
            raise ProtocolError(f"a {kind} header cut short inside its extras")
        extras = unpack_map(head[at:at + size], f"{kind} header's extras")
        at += size
        if extras.keys() & header.keys() or Field.EMBEDDED in extras:
            raise ProtocolError(f"a {kind} header's extras repeat its fixed fields")
        header.update(extras)
    if flags & Hot.EMBEDDED:
        header[Field.EMBEDDED] = bytes(head[at:])
    elif at != len(head):
        raise ProtocolError(f"a {kind} header with {len(head) - at} bytes after its end")
    return header


def taken(fields: tuple) -> tuple[dict[str, Any], list[Any]]:
    """A reply as Channel.take hands it over (HOT_HEAD's fields and the payload) as the
    message unpack gives."""
    header = decode(HOT_HEAD.pack(*fields[:-1]))
    header.pop(Field.EMBEDDED, None)
    return header, [] if fields[-1] is None else [fields[-1]]


def unpack_map(data: Any, what: str) -> dict[str, Any]:
    try:
        value = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # only reachable with a valid MAC, i.e. our own bug
        raise ProtocolError(f"undecodable {what}: {exc}") from None
    if type(value) is not dict:
        raise ProtocolError(f"{what} is {type(value).__name__}, expected a map")
    return value


def version_refused(version: int) -> str:
    """Why a message of another wire version is refused (the sender holds the secret:
    it is a rank or a runner of another reactor_dist version)."""
    if 0x80 <= version <= 0x8F or version in (0xDE, 0xDF):
        return (f"a message in the first wire format (a bare msgpack header): its sender "
                f"runs an older reactor_dist than this process (wire version "
                f"{WIRE_VERSION}); install the same reactor_dist version for the runner "
                f"and every rank")
    return (f"a message of wire version {version}, but this process speaks version "
            f"{WIRE_VERSION}: the runner and its ranks run different reactor_dist "
            f"versions; install the same one for the runner and every rank")


def receive(sock: zmq.Socket, flags: int = 0) -> list[Any]:
    """One whole message's frames, not yet verified (blocking; zmq.Again after RCVTIMEO).

    Frames are taken as zmq.Frame, whose ``more`` flag is a plain attribute: asking
    the socket for RCVMORE goes through pyzmq's option enum, about 1 us a message.
    A frame over COPY_LIMIT stays a view of ZeroMQ's buffer: a stranger's big
    forged frame is never copied, and an authentic big body is copied no more.
    A message over MAX_MESSAGE in all is let go frame by frame as it comes.  ``flags``:
    zmq.NOBLOCK for a message only if one has arrived (else zmq.Again)."""
    frame = sock.recv(flags, copy=False)
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
    return parts


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
