"""``reactor-dist-rank --join ADDRESS`` (``python -m reactor_dist.rank --join``, which
execs ``python -m reactor_dist.placement.joiner``): one rank that another launcher
started (torchrun, Slurm's ``srun``, a shell) joins a runner with
``placement="external"`` (reactor_dist.placement.external, which lays out the exchange).
The joiner is the runner's agent on the rank's node, as a Ray host is
(reactor_dist.placement.ray_host): it never runs the worker nor speaks the bus.

This process is the rank's joiner: it says which rank it is (torchrun's ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``; Slurm's ``SLURM_PROCID``, ``SLURM_NTASKS``,
``SLURM_LOCALID``; or ``--rank``), gets its bootstrap, starts the rank as its child
(reactor_dist.placement.local.RankProcess: the same rank code as every placement's)
and answers for it until one of them ends:

    its rank dies           it tells the runner (crash report, last lines), exits 1
    the runner ends it      at shutdown exits 0, at a restart 1 (its launcher restarts it)
    the runner falls silent it ends its rank and exits 0 (torchrun and srun end too)
    SIGTERM, SIGINT         it ends its rank, tells the runner, exits 143 (130)

Exit code 2: refused (the runner says why) or no runner answered.  The secret comes
from ``--secret-file`` (mode 0600) or ``REACTOR_DIST_JOIN_SECRET``, never argv.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shutil
import signal
import socket
import stat
import sys
import threading
import time
from typing import Any

import msgpack
import zmq
from zmq.utils.monitor import recv_monitor_message

from .. import __version__
from ..shm import segments
from ..wire.protocol import (
    JOIN_BEAT_EVERY,
    JOIN_KIND,
    JOIN_SECRET_ENV,
    OWNER_LOCK,
    RUNNER_SILENCE,
    WIRE_VERSION,
    Bootstrap,
    Join,
    split_join_secret,
)
from .base import Ranks
from .local import RankProcess

POLL_MS = 20
RECLAIM_WITHIN = 1.0  # seconds a dead runner's owner lock may take to come free
REFUSED = 2  # the exit code of a join the runner refused, or that nobody answered
# Where a launcher says which rank a process is: (its name, rank, world size, local rank).
LAUNCHERS = (("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"),
             ("Slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"))


class Refused(SystemExit):
    """The join ends before a rank started: the message says why."""

    def __init__(self, why: str) -> None:
        print(f"reactor-dist-rank: {why}", file=sys.stderr, flush=True)
        super().__init__(REFUSED)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    join = parser.add_argument_group(
        "joining a runner (placement='external'): a rank that another launcher started")
    join.add_argument("--join", metavar="ADDRESS",
                      help="the runner's join address, e.g. tcp://10.0.0.1:5555 (printed by "
                           "its start(), and its runner.join_command)")
    join.add_argument("--worker", metavar="MODULE:CLASS",
                      help="the worker class, as the runner names it")
    join.add_argument("--secret-file", metavar="PATH",
                      help=f"the join secret's file (mode 0600); else ${JOIN_SECRET_ENV}")
    join.add_argument("--rank", type=int, help="this rank (else from torchrun's or Slurm's "
                                               "environment)")
    join.add_argument("--world-size", type=int, help="with --rank: the runner's world size")
    join.add_argument("--local-rank", type=int,
                      help="with --rank: its GPU's index among the visible ones (default 0)")
    join.add_argument("--timeout", type=float, default=600.0,
                      help="seconds to wait for the runner's welcome (default 600)")


def which_rank(args: argparse.Namespace, env: dict[str, str]) -> tuple[int, int | None, int]:
    """(rank, world size or None, local rank): ``--rank``, else the launcher's."""
    if args.rank is not None:
        return args.rank, args.world_size, args.local_rank or 0
    for _name, rank, size, local in LAUNCHERS:
        if rank in env:
            try:
                return int(env[rank]), int(env[size]) if size in env else None, \
                    int(env.get(local, "0"))
            except ValueError:
                raise Refused(f"{rank}={env[rank]!r}, {size}={env.get(size)!r}, "
                              f"{local}={env.get(local)!r}: not whole numbers") from None
    raise Refused("which rank is this? give --rank N, or start it under torchrun (RANK, "
                  "WORLD_SIZE, LOCAL_RANK) or srun (SLURM_PROCID, SLURM_NTASKS, "
                  "SLURM_LOCALID)")


def read_secret(path: str | None) -> tuple[bytes, bytes]:
    """(the runner's public key, the join key's secret half), from the file (which
    nobody else may read) or the environment (then removed from it: the rank's own
    environment does not carry it)."""
    if path:
        try:
            mode = os.stat(path).st_mode
            if mode & (stat.S_IRWXG | stat.S_IRWXO):
                raise Refused(f"the secret file {path} may be read by others (mode "
                              f"{stat.S_IMODE(mode):o}): chmod 600 {path}")
            with open(path) as f:
                text = f.read()
        except OSError as exc:
            raise Refused(f"cannot read the secret file {path}: {exc.strerror}") from None
    else:
        text = os.environ.pop(JOIN_SECRET_ENV, "")
        if not text:
            raise Refused(f"no join secret: give --secret-file PATH (the runner prints it) "
                          f"or set {JOIN_SECRET_ENV}")
    try:
        return split_join_secret(text)
    except ValueError as exc:
        raise Refused(str(exc)) from None


def outward_address(endpoint: str) -> str:
    """This machine's address on the way to the runner's (no packet is sent): where the
    group's store listens if this is rank 0."""
    host = endpoint.removeprefix("tcp://").rpartition(":")[0].strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, 9))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def free_port(address: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as s:
        s.bind((address, 0))
        return s.getsockname()[1]


class Joiner:
    """One rank's joiner: the join socket's client, and its rank's parent."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.endpoint = args.join
        if not args.worker or ":" not in args.worker:
            raise Refused("--worker MODULE:CLASS is needed: the worker class, as the runner "
                          "names it (its join command says)")
        self.worker, self.timeout = args.worker, args.timeout
        self.rank, self.world_size, self.local_rank = which_rank(args, dict(os.environ))
        self.server, client_secret = read_secret(args.secret_file)
        self.keys = (zmq.curve_public(client_secret), client_secret)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 1000)  # the last word (died, ended) leaves
        self.sock.routing_id = b"j" + os.urandom(7)  # the same across a reconnect
        self.sock.curve_serverkey = self.server
        self.sock.curve_publickey, self.sock.curve_secretkey = self.keys
        self.monitor = self.sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL |
            zmq.EVENT_DISCONNECTED)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)
        self.disconnected = False  # the runner's end closed (its process died)
        self.heard = 0.0  # when the runner last spoke (0: not yet)
        self.stopping = 0  # the signal that asks us to end (SIGTERM, SIGINT)
        self.ranks = Ranks(lambda dead: None)
        self.answers: list[dict[str, Any]] = []  # from helper threads, sent by the loop
        self.probe = ""
        self.boot: Bootstrap | None = None  # once welcomed
        self.private_dir = ""  # the runner's, where it runs on this machine

    def send(self, message: dict[str, Any]) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self.sock.send(msgpack.packb(message, use_bin_type=True), zmq.NOBLOCK)

    def receive(self, timeout_ms: int) -> dict[str, Any] | None:
        """The runner's next message within ``timeout_ms``; a refused handshake ends the
        join."""
        ready = dict(self.poller.poll(timeout_ms))
        if self.monitor in ready:
            event = recv_monitor_message(self.monitor)
            if event["event"] == zmq.EVENT_DISCONNECTED:
                # Once welcomed, the kernel closed the runner's end: it died (SIGKILL,
                # a crash), which its silence would say only RUNNER_SILENCE s later.
                self.disconnected = self.boot is not None
                return None
            raise Refused(f"the runner at {self.endpoint} refused this rank's join secret "
                          f"(CurveZMQ handshake failed, code {event.get('value')}): use the "
                          f"secret that runner wrote, from its secret file")
        if self.sock not in ready:
            return None
        self.heard = time.monotonic()
        try:
            message = msgpack.unpackb(self.sock.recv(), raw=False)
        except ValueError:  # not msgpack (the runner authenticated: never ours to fear)
            return None
        return message if isinstance(message, dict) and JOIN_KIND in message else None

    def hello(self) -> dict[str, Any]:
        """Say hello and wait for the welcome (its bootstrap and torch environment)."""
        self.probe = f"reactor-dist-probe-{os.getpid()}-{os.urandom(4).hex()}"
        content = os.urandom(16)
        with contextlib.suppress(OSError):
            fd = os.open(os.path.join("/dev/shm", self.probe),
                         os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.write(fd, content)
            os.close(fd)
        address = outward_address(self.endpoint)
        self.sock.connect(self.endpoint)
        self.send({JOIN_KIND: Join.HELLO, "version": __version__, "wire": WIRE_VERSION,
                   "rank": self.rank, "world_size": self.world_size,
                   "local_rank": self.local_rank, "worker": self.worker,
                   "host": socket.gethostname(), "pid": os.getpid(), "address": address,
                   "port": free_port(address), "probe": [self.probe, content]})
        deadline = time.monotonic() + self.timeout
        while True:
            if self.stopping:
                raise SystemExit(128 + self.stopping)
            if self.heard and time.monotonic() - self.heard > RUNNER_SILENCE:
                raise Refused(f"the runner at {self.endpoint} fell silent before it welcomed "
                              f"rank {self.rank}")
            if time.monotonic() > deadline:
                raise Refused(f"no runner answered at {self.endpoint} within "
                              f"{self.timeout:g} s (a wrong address, a runner not started, "
                              f"or a secret of another runner)")
            message = self.receive(100)
            if message is None:
                continue
            if message[JOIN_KIND] == Join.REFUSED:
                raise Refused(f"the runner refused rank {self.rank}: {message.get('why')}")
            if message[JOIN_KIND] == Join.WELCOME:
                return message
            if message[JOIN_KIND] == Join.BEAT:
                self.send({JOIN_KIND: Join.BEAT})

    def start_rank(self, welcome: dict[str, Any]) -> RankProcess:
        boot = Bootstrap.read_bytes(welcome["bootstrap"])
        # The client keys are this joiner's; the rank watches this process as its runner
        # (it ends when we do), and imports from where we do.
        boot = dataclasses.replace(boot, curve=(self.server, *self.keys),
                                   runner_pid=os.getpid(), sys_path=list(sys.path))
        proc = RankProcess.spawn(self.rank, boot.world_size, boot.to_bytes(), master_port=0,
                                 env={}, gpus=None, launch_prefix=[],
                                 torch_env=dict(welcome["torch_env"]))
        self.ranks.add(proc)
        self.boot, self.private_dir = boot, str(welcome.get("private_dir", ""))
        self.send({JOIN_KIND: Join.STARTED, "pid": proc.pid})
        return proc

    def serve(self, proc: RankProcess) -> int:
        """Answer for the rank until one of us ends: the exit code."""
        beat = 0.0
        while True:
            message = self.receive(POLL_MS)
            if message is not None:
                code = self.answer(message, proc)
                if code is not None:
                    return code
            while self.answers:
                self.send(self.answers.pop(0))
            now = time.monotonic()
            if not proc.alive():
                report = proc.crash_report().replace(  # where it ran, for the runner
                    f"(pid {proc.pid})", f"(pid {proc.pid} on {socket.gethostname()})", 1)
                self.send({JOIN_KIND: Join.DIED, "report": report,
                           "returncode": proc.poll(), "lines": proc.report_lines()})
                self.ranks.end(0.0, 0.5)
                return 1
            if self.stopping:
                name = signal.Signals(self.stopping).name
                self.ranks.end(0.0, 2.0)
                self.send({JOIN_KIND: Join.DIED, "returncode": -self.stopping, "lines": [],
                           "report": f"rank {self.rank} (pid {proc.pid}) ended: its launcher"
                                     f" stopped its joiner ({name})"})
                return 128 + self.stopping
            if self.disconnected or now - self.heard > RUNNER_SILENCE:
                how = "closed its connection" if self.disconnected else "fell silent"
                print(f"reactor-dist-rank: the runner at {self.endpoint} {how}: rank "
                      f"{self.rank} ends", file=sys.stderr, flush=True)
                self.ranks.end(0.0, 0.5)
                self.reclaim()
                return 0
            if now - beat >= JOIN_BEAT_EVERY:
                beat = now
                self.send({JOIN_KIND: Join.BEAT})

    def reclaim(self) -> None:
        """The runner is gone: if it shared this machine's memory and is dead (its owner
        locks free), remove what it left in /dev/shm and its private directory, as its
        own ranks would; only this runner's, and never a live one's."""
        boot = self.boot
        if boot is None or not boot.shared_memory:
            return
        lock = os.path.join(boot.shm_dir, f"{boot.shm_prefix}.{OWNER_LOCK}")
        deadline = time.monotonic() + RECLAIM_WITHIN
        while os.path.lexists(lock) and not segments.lock_free(lock):
            if time.monotonic() > deadline:
                return  # alive after all (a network gone, not the runner): not ours
            time.sleep(0.02)  # a SIGKILLed owner may still be exiting
        for _ in range(2):  # again: a rank of another joiner may have made one meanwhile
            segments.remove_prefix(boot.shm_dir, boot.shm_prefix)
            time.sleep(0.05)
        private = self.private_dir
        owner = os.path.join(private, OWNER_LOCK)
        if private and os.path.lexists(owner) and segments.lock_free(owner):
            shutil.rmtree(private, ignore_errors=True)

    def answer(self, message: dict[str, Any], proc: RankProcess) -> int | None:
        kind = message[JOIN_KIND]
        if kind == Join.SIGNAL:
            proc.signal(int(message["sig"]), bool(message.get("group", True)))
        elif kind == Join.STOPPED:
            self.send({JOIN_KIND: Join.STOPPED, "value": proc.stopped()})
        elif kind == Join.STACKS:
            ident = message.get("id", 0)

            def dump() -> None:
                self.answers.append({JOIN_KIND: Join.STACKS, "id": ident,
                                     "text": self.ranks.stacks([0])})

            threading.Thread(target=dump, name="reactor-dist-stacks", daemon=True).start()
        elif kind == Join.END:
            self.ranks.end(float(message.get("grace", 0.0)),
                           float(message.get("term_grace", 2.0)))
            self.send({JOIN_KIND: Join.ENDED})
            return int(message.get("code", 0))
        return None

    def remove_probe(self) -> None:
        if self.probe:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join("/dev/shm", self.probe))
            self.probe = ""

    def close(self) -> None:
        self.remove_probe()
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close()
        self.ctx.term()


def run(args: argparse.Namespace) -> int:
    """Join, start the rank, answer for it: the exit code (see the module's text)."""
    joiner = Joiner(args)

    def stop(signum: int, frame: Any) -> None:
        joiner.stopping = signum

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    try:
        welcome = joiner.hello()
        joiner.remove_probe()  # the runner has read it
        return joiner.serve(joiner.start_rank(welcome))
    finally:
        joiner.ranks.end(0.0, 0.5)
        joiner.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="reactor-dist-rank --join",
        description="Joins one rank that another launcher started (torchrun, srun, a "
                    "shell) to a DistributedRunner with placement='external': says which "
                    "rank it is, starts it, answers for it until the runner or the rank "
                    "ends. Exit 0: the runner ended; 1: the rank died or was replaced; 2: "
                    "refused, or no runner answered.")
    add_arguments(parser)
    args = parser.parse_args(argv)
    if not args.join:
        parser.error("--join ADDRESS is needed (the runner's start() prints it)")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
