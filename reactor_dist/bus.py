"""The runner's end of the message bus: PUB for commands, PULL for replies.

Both sockets are bound on ``ipc://`` paths in the runner's private directory
(mode 0700); with ranks on other nodes (placement="ray") also on TCP, encrypted and
authenticated by CurveZMQ (:meth:`Bus.open_tcp`).  The death watch's notices
arrive on the PULL socket too (over inproc), so that waiting for a call's replies
is one blocking receive, which a death also wakes.  Every message is authenticated
(:mod:`reactor_dist.wire`) before anything in it is decoded; what is not ours is
dropped unread.
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
from typing import Any

import psutil
import zmq

from . import shm, timeouts, wire
from .protocol import IPC_DIR_PREFIX, OWNER_LOCK, Field, Kind, ipc_dir_owner

# A wait may end this much before or after its deadline: a call's second receive then
# keeps the first one's RCVTIMEO instead of setting it anew.
TIMEOUT_SLACK_MS = 5
FOREVER_MS = 1 << 62
ZAP_DOMAIN = "reactor-dist"


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
                dead = shm.lock_free(lock) if os.path.lexists(lock) else \
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
        self.channel = wire.Channel(secret)
        self.pub = wire.bounded(self.ctx.socket(zmq.PUB))
        # One call at a time keeps each rank's queue a few messages deep; the bound only
        # stops a stray subscriber that never reads from growing our memory.
        self.pub.setsockopt(zmq.SNDHWM, 1000)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.cmd_addr = f"ipc://{ipc_dir}/cmd"
        self.pub.bind(self.cmd_addr)
        self._pub_send = wire.direct_send(self.pub)
        self.pull = wire.bounded(self.ctx.socket(zmq.PULL))
        self.pull.setsockopt(zmq.LINGER, 0)
        self.reply_addr = f"ipc://{ipc_dir}/reply"
        self.pull.bind(self.reply_addr)
        self.death_addr = f"inproc://reactor-dist-deaths-{id(self):x}"
        self.pull.bind(self.death_addr)
        self.pull_fd = self.pull.get(zmq.FD)  # for an event loop's add_reader (aio.py)
        self.pull_events = functools.partial(super(zmq.Socket, self.pull).get, zmq.EVENTS)
        self._pub_open = False  # a multipart command is half-sent (interrupted)
        self.pub_lock = threading.Lock()  # the caller's thread and the releaser's
        self.auth: Any = None  # zmq.auth's thread, once open_tcp() admits remote ranks
        self._pull_timeout = -1  # the PULL socket's RCVTIMEO, in ms

    def open_tcp(self, address: str, clients: set[bytes]) -> tuple[str, str, bytes]:
        """Bind both sockets on ``address`` (this node's, as Ray reports it) too, for
        ranks on other nodes: CurveZMQ under a new server keypair, and only the
        ``clients``' public keys admitted (zmq.auth); the ipc endpoints, bound before,
        stay plain.  Returns (command address, reply address, server public key)."""
        from zmq.auth.thread import ThreadAuthenticator

        public, secret = zmq.curve_keypair()
        self.auth = ThreadAuthenticator(self.ctx, log=logging.getLogger("reactor_dist.auth"))
        self.auth.start()
        self.auth.configure_curve_callback(domain=ZAP_DOMAIN,
                                           credentials_provider=_Admitted(clients))
        host = f"[{address}]" if ":" in address else address
        addresses = []
        for sock in (self.pub, self.pull):
            if ":" in address:
                sock.setsockopt(zmq.IPV6, 1)
            sock.curve_server, sock.curve_secretkey, sock.curve_publickey = True, secret, public
            sock.zap_domain = ZAP_DOMAIN.encode()
            port = sock.bind_to_random_port(f"tcp://{host}")
            addresses.append(f"tcp://{host}:{port}")
        self.server_key = public
        return addresses[0], addresses[1], public

    def publish(self, header: dict[str, Any], body: list | tuple = ()) -> None:
        """Send one command to every rank (from any thread: see reactor_dist.releaser)."""
        header[Field.RANK] = -1
        with self.pub_lock:  # the packer's buffer too is one per channel
            frames = self.channel.pack(header, body)
            if self._pub_open:
                # A Ctrl-C cut the last command short: end that message with an empty
                # frame (the ranks reject it: its MAC fails) so it cannot swallow this one.
                self.pub.send(b"")
            self._pub_open = True
            wire.send(self._pub_send, frames)
            self._pub_open = False

    def receive(self, wait_ms: int) -> tuple[dict, list] | None:
        """The next message if it is an authentic reply or death notice; None when
        ``wait_ms`` (-1: no limit) passed first or the message is not ours."""
        wait_ms = min(wait_ms, timeouts.SLICE_MS)  # RCVTIMEO is a C int: the caller loops on
        want = wait_ms if wait_ms >= 0 else FOREVER_MS
        have = self._pull_timeout if self._pull_timeout >= 0 else FOREVER_MS
        if abs(want - have) > TIMEOUT_SLACK_MS:  # most calls keep the last setting
            self.pull.setsockopt(zmq.RCVTIMEO, wait_ms)
            self._pull_timeout = wait_ms
        try:
            header, body = self.channel.recv(self.pull)
        except (zmq.Again, wire.ProtocolError):
            return None
        if header[Field.KIND] not in Kind.TO_RUNNER or \
                not 0 <= header[Field.RANK] < self.world_size:
            return None
        return header, body

    def tell_death(self, ranks: list[int]) -> None:
        """In the death watch's thread: wake the caller's wait with a notice."""
        with contextlib.suppress(zmq.ZMQError):
            push = wire.bounded(self.ctx.socket(zmq.PUSH))
            push.setsockopt(zmq.LINGER, 1000)
            push.connect(self.death_addr)
            notice = {Field.KIND: Kind.DEATH, Field.SEQ: 0, Field.RANK: ranks[0]}
            wire.Channel(self.secret).send(push.send, notice)
            push.close()

    def close(self) -> None:
        self.pub.close(linger=0)
        self.pull.close(linger=0)
        if self.auth is not None:
            self.auth.stop()
        self.ctx.term()


class _Admitted:
    """zmq.auth's CURVE credentials provider: the runner's own ranks' keys alone."""

    def __init__(self, keys: set[bytes]) -> None:
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        return domain == ZAP_DOMAIN and key in self.keys
