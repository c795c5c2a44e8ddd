"""The runner's end of the message bus: PUB for commands, PULL for replies.

Both sockets are bound on ``ipc://`` paths in the runner's private directory
(mode 0700); with ranks on other nodes (placement="ray") also on TCP, encrypted and
authenticated by CurveZMQ (:meth:`Bus.open_tcp`).  The death watch's notices
arrive on the PULL socket too (over inproc), so that waiting for a call's replies
is one blocking receive, which a death also wakes.  Every message is authenticated
(:mod:`reactor_dist.wire.framing`) before anything in it is decoded; what is not ours is
dropped unread.

No command is ever dropped: the command socket is an XPUB with ``ZMQ_XPUB_NODROP``, so
a rank's pipe at its bound (``SNDHWM``, :data:`~reactor_dist.wire.protocol.SEND_BOUND_ENV`)
makes a send fail with EAGAIN instead of losing the message for that rank (a plain PUB
drops it silently).  libzmq checks the bound at a message's first frame only (a
message's later frames never fail), and then for every rank: a command reaches every
rank or none.  :meth:`Bus.publish` does at the bound what the command kind's row of
``protocol.COMMANDS`` says: one try, or tries until a deadline (POLLOUT means nothing
on an XPUB: ZeroMQ says "writable" whatever the pipes hold, so it sleeps between
tries).  docs/design/wire.md ("No command is lost") tells the table.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import os
import secrets
import shutil
import stat
import tempfile
import threading
import time
from typing import Any

import psutil
import zmq

from .. import timeouts
from ..shm import segments
from ..wire import framing
from ..wire.protocol import (
    COMMANDS,
    IPC_DIR_PREFIX,
    OWNER_LOCK,
    SEND_BOUND_DEFAULT,
    SEND_BOUND_ENV,
    Delivery,
    Field,
    Kind,
    ipc_dir_owner,
)

# A wait may end this much before or after its deadline: a call's second receive then
# keeps the first one's RCVTIMEO instead of setting it anew.
TIMEOUT_SLACK_MS = 5
FOREVER_MS = 1 << 62
ZAP_DOMAIN = "reactor-dist"
# Bus.publish at the bound: the first pause between tries, and the longest one.
RETRY_FIRST, RETRY_MOST = 0.0005, 0.01
REJECTIONS_LOGGED = 3  # dropped messages that get a log record each (rejected)
NOBLOCK = int(zmq.NOBLOCK)
ACK_RANK, ACK_SEQ = 4, 5  # an acknowledgement's rank and call, among HOT_HEAD's fields
log = logging.getLogger("reactor_dist")
_FIRST, _FIRST_OF_MORE, _MORE = int(zmq.NOBLOCK), int(zmq.NOBLOCK | zmq.SNDMORE), int(zmq.SNDMORE)


class CommandBlocked(TimeoutError):
    """Bus.publish's deadline passed while a rank's pipe stayed at its bound: the
    command was sent to no rank."""


def send_bound() -> int:
    """The bound of one rank's pipe of commands (SEND_BOUND_ENV, else the default)."""
    raw = os.environ.get(SEND_BOUND_ENV) or str(SEND_BOUND_DEFAULT)
    try:
        bound = int(raw)
    except ValueError:
        bound = 0
    if bound < 1:
        raise ValueError(f"{SEND_BOUND_ENV}={raw!r}: give a whole number of commands, at "
                         f"least 1 (the default is {SEND_BOUND_DEFAULT}), or unset it")
    return bound


def reclaim_dead_ipc_dirs() -> None:
    """Private directories of runners killed together with their ranks: a dead owner's
    directory is ours to remove (never a live one's).  A live owner holds the lock
    inside it (its pid may mean nothing here: another pid namespace); a directory
    without one, of an older version, is judged by the pid in its name."""
    for base in {tempfile.gettempdir(), "/tmp"}:
        try:
            names = os.listdir(base)
        except OSError:
            continue
        for name in names:
            owner = ipc_dir_owner(name)
            if owner is None:
                continue
            path = os.path.join(base, name)
            with contextlib.suppress(OSError):
                st = os.lstat(path)  # never a link, never another user's
                if not (stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()):
                    continue
                lock = os.path.join(path, OWNER_LOCK)
                dead = segments.lock_free(lock) if os.path.lexists(lock) else \
                    not psutil.pid_exists(owner)
                if dead:
                    shutil.rmtree(path, ignore_errors=True)


def private_dir() -> tuple[str, int]:
    """A new private directory (mode 0700) and the descriptor that holds the lock inside
    it while its runner lives.  The directory gets its name only once locked, so that
    nobody ever sees it unlocked while its owner lives."""
    base = tempfile.gettempdir()
    if len(base) > 60:  # ipc:// paths are limited to ~107 bytes
        base = "/tmp"
    draft = tempfile.mkdtemp(prefix=".reactor-dist-draft-", dir=base)
    fd = os.open(os.path.join(draft, OWNER_LOCK), os.O_CREAT | os.O_EXCL | os.O_RDWR |
                 os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        path = os.path.join(base, f"{IPC_DIR_PREFIX}{os.getpid()}-{secrets.token_hex(4)}")
        os.rename(draft, path)
    except BaseException:
        os.close(fd)
        shutil.rmtree(draft, ignore_errors=True)
        raise
    return path, fd


class Bus:
    """The runner's two sockets; used from the caller's thread (under the runner's lock),
    but for :meth:`tell_death`, which the death watch's thread calls."""

    def __init__(self, secret: bytes, ipc_dir: str, world_size: int) -> None:
        self.ctx = zmq.Context()
        try:
            self._open(secret, ipc_dir, world_size)
        except BaseException:  # out of descriptors, say: give back what was taken
            self.ctx.destroy(linger=0)  # closes the sockets made so far
            raise

    def _open(self, secret: bytes, ipc_dir: str, world_size: int) -> None:
        self.secret, self.world_size = secret, world_size
        self.channel = framing.Channel(secret)
        self.take = self.channel.take
        self.bound = send_bound()
        self.pub = framing.bounded(self.ctx.socket(zmq.XPUB))
        # One call at a time keeps each rank's queue a few messages deep; the bound stops
        # a rank that does not read (stopped, starved) from growing our memory, and at it
        # a send fails (NODROP) rather than losing the command for that rank.
        self.pub.setsockopt(zmq.SNDHWM, self.bound)
        self.pub.setsockopt(zmq.XPUB_NODROP, 1)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.cmd_addr = f"ipc://{ipc_dir}/cmd"
        self.pub.bind(self.cmd_addr)
        self._pub_send = framing.direct_send(self.pub)
        self.pull = framing.bounded(self.ctx.socket(zmq.PULL))
        self.pull.setsockopt(zmq.LINGER, 0)
        self.reply_addr = f"ipc://{ipc_dir}/reply"
        self.pull.bind(self.reply_addr)
        self.death_addr = f"inproc://reactor-dist-deaths-{id(self):x}"
        self.pull.bind(self.death_addr)
        self.pull_fd = self.pull.get(zmq.FD)  # for an event loop's add_reader (aio.py)
        # framing's compiled half reads the reply socket by its handle (0 once closed).
        self.wire, self.pull_handle = self.channel.wire, self.pull.underlying
        self.pull_events = functools.partial(super(zmq.Socket, self.pull).get, zmq.EVENTS)
        self._pub_open = False  # a multipart command is half-sent (interrupted)
        self.pub_lock = threading.Lock()  # the caller's thread and the releaser's
        self.auth: Any = None  # zmq.auth's thread, once open_tcp() admits remote ranks
        # The spares' socket (spares.py, which reads and closes it), for open_tcp.
        self.spare_pull: zmq.Socket | None = None
        self._pull_timeout = -1  # the PULL socket's RCVTIMEO, in ms
        self.rejections = 0  # messages dropped unread (rejected)

    def open_tcp(self, address: str, clients: set[bytes]) -> tuple[str, str, str, bytes]:
        """Bind both sockets, and the spares' (:attr:`spare_pull`) where there is one, on
        ``address`` (this node's, as Ray reports it) too, for ranks on other nodes:
        CurveZMQ under a new server keypair, and only the ``clients``' public keys
        admitted (zmq.auth); the ipc endpoints, bound before, stay plain.  Returns
        (command address, reply address, spares' address or "", server public key)."""
        from zmq.auth.thread import ThreadAuthenticator

        public, secret = zmq.curve_keypair()
        self.auth = ThreadAuthenticator(self.ctx, log=logging.getLogger("reactor_dist.auth"))
        self.auth.start()
        self.auth.configure_curve_callback(domain=ZAP_DOMAIN,
                                           credentials_provider=_Admitted(clients))
        self.server_key, self._server_secret = public, secret
        addresses = [self.bind_secure(sock, address) if sock is not None else ""
                     for sock in (self.pub, self.pull, self.spare_pull)]
        return addresses[0], addresses[1], addresses[2], public

    def bind_secure(self, sock: zmq.Socket, address: str, port: int = 0) -> str:
        """Bind ``sock`` (of this bus's context) on TCP at ``address`` (``port`` 0: a free
        one) as a CurveZMQ server under the bus's keypair (:meth:`open_tcp` made it), only
        the admitted clients' keys let in; the endpoint bound."""
        host = f"[{address}]" if ":" in address else address
        if ":" in address:
            sock.setsockopt(zmq.IPV6, 1)
        sock.curve_server, sock.curve_publickey = True, self.server_key
        sock.curve_secretkey = self._server_secret
        sock.zap_domain = ZAP_DOMAIN.encode()
        if port:
            sock.bind(f"tcp://{host}:{port}")
        else:
            port = sock.bind_to_random_port(f"tcp://{host}")
        return f"tcp://{host}:{port}"

    def publish(self, header: dict[str, Any], body: list | tuple = (),
                deadline: float | None = None) -> bool:
        """Send one command to every rank, as its kind's row of ``protocol.COMMANDS``
        says: True when sent.  At a rank's full pipe a ``Delivery.DEADLINE`` kind is tried
        again until ``deadline`` (time.monotonic(); None: no limit; the past: one try),
        then raises CommandBlocked (the command went to no rank); any other kind is tried
        once, and False says that it went to no rank (its sender tries again later).
        Any thread may publish (see reactor_dist.caller.releaser)."""
        patient = COMMANDS[header[Field.KIND]].delivery is Delivery.DEADLINE
        if deadline is not None and not patient:
            raise ValueError(f"a {header[Field.KIND]} command is tried once: no deadline")
        header[Field.RANK] = -1
        with self.pub_lock:  # the packer's buffer too is one per channel
            frames = self.channel.pack(header, body)
            if self._send(frames):  # the common command: one lock cycle
                return True
            self._drop_subscriptions()
        pause = RETRY_FIRST
        while True:
            if not patient:
                return False
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise CommandBlocked(
                    f"a {header.get(Field.KIND)} command found a rank's pipe holding "
                    f"{self.bound} commands it has not taken up ({SEND_BOUND_ENV})")
            time.sleep(pause if left is None else min(pause, left))
            pause = min(pause * 2, RETRY_MOST)
            with self.pub_lock:
                if self._send(frames):
                    return True
                self._drop_subscriptions()

    def _send(self, frames: list[Any]) -> bool:
        """One try: False when the first frame met a full pipe (then nothing was sent)."""
        if self._pub_open:
            # A Ctrl-C cut the last command short: end that message with an empty frame
            # (the ranks reject it: its MAC fails) so it cannot swallow this one.  A later
            # frame never meets the bound; Again: the cut came before the first frame.
            with contextlib.suppress(zmq.Again):
                self.pub.send(b"", zmq.NOBLOCK)
            self._pub_open = False
        self._pub_open = True
        try:
            self._pub_send(frames[0], _FIRST_OF_MORE if len(frames) > 1 else _FIRST)
        except zmq.Again:
            self._pub_open = False
            return False
        if len(frames) > 1:
            for frame in frames[1:-1]:
                self._pub_send(frame, _MORE)
            self._pub_send(frames[-1])
        self._pub_open = False
        return True

    def _drop_subscriptions(self) -> None:
        """An XPUB hands us each new subscription (a rank joining) to read: read them, so
        they never pile up (without XPUB_VERBOSE only the first and last of a topic)."""
        with contextlib.suppress(zmq.Again):
            while True:
                self.pub.recv(zmq.NOBLOCK)

    def receive(self, wait_ms: int, acks: bool = False) -> tuple | None:
        """The next message if it is an authentic reply or death notice: ``(header, body)``,
        or with ``acks`` a plain reply as HOT_HEAD's fields and its payload
        (:meth:`framing.Channel.take`: the call queue counts it into its call); None when
        ``wait_ms`` (-1: no limit) passed first or the message is not ours."""
        flags = self.flags_for(wait_ms)
        try:
            parts = framing.receive(self.pull, flags) if self.wire is None else \
                self.wire.receive(self.pull_handle, flags)
        except zmq.Again:
            return None
        return self.judge(parts, acks)

    def flags_for(self, wait_ms: int) -> int:
        """The receive flags for a wait of ``wait_ms``, the socket's RCVTIMEO set for it."""
        if wait_ms == 0:  # no wait: the socket's RCVTIMEO stays what the waits want
            return NOBLOCK
        if wait_ms != self._pull_timeout:  # most calls keep the last setting
            self.set_timeout(wait_ms)
        return 0

    def judge(self, parts: list[Any], acks: bool) -> tuple | None:
        """:meth:`receive`'s answer for one message's frames, as received."""
        try:
            message = self.take(parts)
        except framing.ProtocolError as exc:
            self.rejected(exc)
            return None
        return self.admitted(message, acks)

    def admitted(self, message: tuple, acks: bool) -> tuple | None:
        """A verified message (:meth:`framing.Channel.take`'s) if it is for the runner and of
        one of its ranks, else None."""
        if len(message) != 2:  # a plain reply: HOT_HEAD's fields, its payload (Channel.take)
            if not 0 <= message[ACK_RANK] < self.world_size:
                return None
            return message if acks else framing.taken(message)
        header = message[0]
        if header[Field.KIND] not in Kind.TO_RUNNER or \
                not 0 <= header[Field.RANK] < self.world_size:
            return None
        return message

    def gather(self, seq: int, owed: int, wait_ms: int, until: float | None) -> list[tuple]:
        """What :meth:`receive` (``acks``) gives, in the order it arrived: each message
        waited for ``wait_ms``, but never past the monotonic ``until`` (None: no limit),
        as long as each is a plain reply of call ``seq`` and fewer than ``owed`` of them
        came.  The caller that waits for its call takes every acknowledgement of it in
        one pass, and any other message ends the pass (its receiver judges it); empty
        when nothing authentic arrived in time.  Every wait of a pass keeps the first
        one's RCVTIMEO unless ``until`` is nearer: setting it costs microseconds.  Where
        framing's compiled half is built, a pass is one call of it (``Wire.gather``)."""
        if self.wire is None:
            return self._gather(seq, owed, wait_ms, until)
        arrived: list[tuple] = []
        while True:
            got, rest, retime = self.wire.gather(
                self.pull_handle, seq, owed, self.world_size, self.flags_for(wait_ms),
                wait_ms, -1.0 if until is None else until)
            arrived += got
            if rest is not None:  # a decoded item (a tuple), or frames to judge
                message = self.admitted(rest, True) if type(rest) is tuple else \
                    self.judge(rest, True)
                if message is not None:
                    arrived.append(message)
                return arrived
            if not retime:
                return arrived
            owed -= len(got)
            wait_ms = timeouts.wait_ms(until - time.monotonic())  # type: ignore[operator]

    def _gather(self, seq: int, owed: int, wait_ms: int, until: float | None) -> list[tuple]:
        """:meth:`gather` in pure Python."""
        arrived: list[tuple] = []
        message = self.receive(wait_ms, True)
        while message is not None:
            arrived.append(message)
            if len(message) == 2 or message[ACK_SEQ] != seq:
                break
            owed -= 1
            if owed <= 0:
                break
            if until is not None and until - time.monotonic() < wait_ms / 1000:
                wait_ms = timeouts.wait_ms(until - time.monotonic())
            message = self.receive(wait_ms, True)
        return arrived

    def set_timeout(self, wait_ms: int) -> None:
        """The reply socket's RCVTIMEO for ``wait_ms``, unless within TIMEOUT_SLACK_MS of
        the last one."""
        wait_ms = min(wait_ms, timeouts.SLICE_MS)  # RCVTIMEO is a C int: the caller loops on
        want = wait_ms if wait_ms >= 0 else FOREVER_MS
        have = self._pull_timeout if self._pull_timeout >= 0 else FOREVER_MS
        if abs(want - have) > TIMEOUT_SLACK_MS:
            self.pull.setsockopt(zmq.RCVTIMEO, wait_ms)
            self._pull_timeout = wait_ms

    def rejected(self, exc: framing.ProtocolError) -> None:
        """A message that is not ours, or of another wire version, is dropped: the first
        REJECTIONS_LOGGED of them with a log record each (never a flood)."""
        self.rejections += 1
        if self.rejections <= REJECTIONS_LOGGED:
            more = " (further ones are dropped unlogged)" \
                if self.rejections == REJECTIONS_LOGGED else ""
            log.warning("reactor_dist: the reply socket dropped a message: %s%s", exc, more)

    def tell_death(self, ranks: list[int], epoch: int = 0) -> None:
        """In the death watch's thread: wake the caller's wait with a notice (``epoch``:
        the generation of ranks it watched; a restart makes older notices stale)."""
        with contextlib.suppress(zmq.ZMQError):
            push = framing.bounded(self.ctx.socket(zmq.PUSH))
            push.setsockopt(zmq.LINGER, 1000)
            push.connect(self.death_addr)
            notice = {Field.KIND: Kind.DEATH, Field.SEQ: 0, Field.RANK: ranks[0],
                      Field.EPOCH: epoch}
            framing.Channel(self.secret).send(push.send, notice)
            push.close()

    def close(self) -> None:
        self.pull_handle = 0  # the compiled half refuses it (ENOTSOCK), as pyzmq would
        self.pub.close(linger=0)
        self.pull.close(linger=0)
        if self.auth is not None:
            self.auth.stop()
        self.ctx.term()


class _Admitted:
    """zmq.auth's CURVE credentials provider: the runner's own ranks' keys alone."""

    def __init__(self, keys: set[bytes]) -> None:
        self.keys = keys
        self.refused: set[bytes] = set()  # each refused key logged once (it reconnects)

    def callback(self, domain: str, key: bytes) -> bool:
        admitted = domain == ZAP_DOMAIN and key in self.keys
        if not admitted and key not in self.refused:
            self.refused.add(key)
            log.warning("refused a connection to the runner's bus: its CurveZMQ key is not "
                        "one this runner gave out (a wrong join secret, or another runner's)")
        return admitted
