"""The honest raw floor of one call: bare pyzmq peers that echo a ~100-byte message.

The caller PUBlishes one 100-byte message; every peer process receives it on a SUB socket
and sends the same bytes back on PUSH; the caller receives ``world_size`` of them on PULL.
No framing, no struct packing, no per-message Python beyond one ``recv`` and one ``send``
on each side. The peers are started the way the runner starts its ranks (a plain
subprocess in a process group of its own, in the caller's session), so the scheduler
treats them alike.

``python -m benchmarks.implementations.raw_floor PUB_ADDR PULL_ADDR RANK`` is one peer.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import zmq

from benchmarks.implementations.procs import child_env, stop_processes

MESSAGE = bytes(range(100))  # what every call sends and every peer echoes
HELLO, BARRIER, STOP = b"H", b"B", b"S"  # control messages, never 100 bytes long
# Like the runner's ranks: a process group of their own, the caller's session (and so its
# scheduler autogroup). Python 3.10 has no process_group=: start_new_session is the
# nearest, and differs in the session.
OWN_GROUP: dict[str, Any] = (
    {"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True})


def peer(pub_addr: str, pull_addr: str, rank: int) -> None:
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub_addr)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(pull_addr)
    tag = str(rank).encode()
    recv, send = sub.recv, push.send
    while True:
        msg = recv()
        if len(msg) == len(MESSAGE):
            send(msg)
        elif len(msg) == len(MESSAGE) + 1:  # a stream: rank 0 sends msg[0] first
            for _ in range(msg[0] if rank == 0 else 0):
                send(MESSAGE)
            send(msg[1:])
        elif msg == STOP:
            break
        else:  # HELLO or BARRIER+token: answer with the rank
            send(msg[:1] + tag + b":" + msg[1:])
    sub.close(0)
    push.close(0)
    ctx.term()


class RawFloor:
    """The caller's side; ``generate`` has a pool's signature so it is timed alike."""

    name = "raw floor"

    def __init__(self, world_size: int, *, own_group: bool = True) -> None:
        self.world_size = world_size
        pub_addr, pull_addr = self.bind("raw")
        self.procs = [
            subprocess.Popen([sys.executable, "-m", "benchmarks.implementations.raw_floor",
                              pub_addr, pull_addr, str(r)], env=child_env(),
                             **(OWN_GROUP if own_group else {}))
            for r in range(world_size)
        ]
        try:
            self._handshake()
        except BaseException:
            self.close()
            raise
        self._send, self._recv = self.pub.send, self.pull.recv
        self._range = range(world_size)

    def _handshake(self) -> None:
        """Ping until every peer answered (PUB drops what a slow joiner missed), then one
        barrier, so that no answer to a ping is left to be taken for an echo."""
        seen: set[bytes] = set()
        deadline = time.monotonic() + 30
        while len(seen) < self.world_size:
            if time.monotonic() > deadline:
                raise RuntimeError("raw floor peers did not connect")
            self.pub.send(HELLO)
            while self.pull.poll(20):
                seen.add(self.pull.recv().split(b":")[0])
        token = os.urandom(8)
        self.pub.send(BARRIER + token)
        done = 0
        while done < self.world_size:
            if not self.pull.poll(30_000):
                raise RuntimeError("raw floor peers did not answer the barrier")
            msg = self.pull.recv()
            done += msg.startswith(BARRIER) and msg.endswith(b":" + token)

    def generate(self, inp: object = None) -> bytes:
        """One call: the message out to every peer, every echo back; rank 0's echo."""
        self._send(MESSAGE)
        recv = self._recv
        for _ in self._range:
            out = recv()
        return out

    def stream(self, items: int) -> bytes:
        """A stream's step: rank 0 sends ``items`` messages, then every peer its echo."""
        self._send(bytes([items]) + MESSAGE)
        recv = self._recv
        for _ in range(items + self.world_size):
            out = recv()
        return out

    def pipelined(self, calls: int, ahead: int) -> None:
        """``calls`` echoes with ``ahead`` of them sent before the first is taken (as a
        runner's submit() with max_in_flight=ahead)."""
        send, recv, world_size = self._send, self._recv, self.world_size
        sent = 0
        for _ in range(min(ahead, calls)):
            send(MESSAGE)
            sent += 1
        for _ in range(calls):
            for _ in range(world_size):
                recv()
            if sent < calls:
                send(MESSAGE)
                sent += 1

    def bind(self, tag: str) -> tuple[str, str]:
        """A private folder with the PUB and PULL sockets bound in it: their addresses
        (the protocol floor's caller binds the same way)."""
        self.tmp = tempfile.mkdtemp(prefix=f"rdbench-{os.getpid()}-{tag}-")
        self.ctx = zmq.Context()
        self.pub, self.pull = self.ctx.socket(zmq.PUB), self.ctx.socket(zmq.PULL)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pull.setsockopt(zmq.LINGER, 0)
        pub_addr, pull_addr = f"ipc://{self.tmp}/cmd", f"ipc://{self.tmp}/rep"
        self.pub.bind(pub_addr)
        self.pull.bind(pull_addr)
        return pub_addr, pull_addr

    def unbind(self, stop: bytes) -> None:
        """Send ``stop``, wait for the peers, close the sockets, remove the folder."""
        self.pub.send(stop)
        stop_processes(self.procs)
        self.pub.close(0)
        self.pull.close(0)
        self.ctx.term()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def close(self) -> None:
        if not self.ctx.closed:
            self.unbind(STOP)


if __name__ == "__main__":
    peer(sys.argv[1], sys.argv[2], int(sys.argv[3]))
