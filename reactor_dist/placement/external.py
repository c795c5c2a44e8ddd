"""Ranks that another launcher starts (torchrun, Slurm's ``srun``, a shell):
``DistributedRunner(..., placement="external")`` or ``placement=External(...)``.

The runner does not start these ranks; it waits for them.  Each is a
``reactor-dist-rank --join ADDRESS`` process (:mod:`reactor_dist.placement.joiner`) that says
which rank it is, gets its bootstrap and starts the rank as its child, as a Ray host
does (reactor_dist.placement.ray_host), then answers for it::

    start()    the bus on TCP (CurveZMQ, the join key alone admitted) and the join socket,
               the join secret written to a 0600 file, the join command printed; every
               rank's hello is awaited, then each is welcomed (a bootstrap names rank 0's
               address, known once rank 0 said hello)
    beats      both ways every JOIN_BEAT_EVERY s: a joiner silent for JOIN_SILENCE s has
               died (SIGKILL, its machine or its network gone), like a rank that died
    restart    the replaced ranks' joiners end their ranks and exit 1, so that their
               launcher starts them again (torchrun's --max-restarts, Slurm's requeue, or
               a person); restart() waits for their hellos; the survivors stay
    close      each joiner ends its rank and exits 0, so that its launcher ends too

Who restarts a dead rank is the launcher, not the runner: there are no spares here.
:class:`ExternalGroup` is the runner's placement (base.Placement), :class:`JoinedRank`
its handle on one rank (base.Rank).  The join socket's messages are laid out in
:mod:`reactor_dist.wire.protocol` (``Join``).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import msgpack
import zmq

from .. import __version__, timeouts
from ..errors import PlacementFailed
from ..wire.protocol import (
    JOIN_BEAT_EVERY,
    JOIN_KIND,
    JOIN_SECRET_ENV,
    JOIN_SILENCE,
    WIRE_VERSION,
    Bootstrap,
    Join,
    join_secret,
    torchrun_env,
)
from .base import DeathWatch, Placement, Rank, Ranks

if TYPE_CHECKING:
    from ..caller.bus import Bus

POLL_MS = 20  # the join socket's thread: how often it looks at its queue and the beats
STOPPED_EVERY = 0.5  # seconds between two questions to a joiner whether its rank is stopped
BEAT = msgpack.packb({JOIN_KIND: Join.BEAT})
STACKS_WITHIN = 10.0  # seconds a joiner has to send its rank's stacks
END_SLACK = 2.0  # seconds a joiner may take beyond the grace it was given to end its rank
log = logging.getLogger("reactor_dist")


@dataclass(frozen=True)
class External:
    """Where a runner with ``placement=External(...)`` waits for the ranks another
    launcher starts (``placement="external"`` is ``External()``).

    :param address: the address the bus and the join socket bind on: loopback by
        default; on a cluster the address of this machine that the ranks' nodes reach.
    :param port: the join socket's port (0: a free one, printed at start()); a fixed one
        lets a job script name it before the runner starts.
    :param secret_file: where the join secret is written (mode 0600, removed at
        shutdown); default: the runner's private directory.  A rank reads it with
        ``--secret-file``, or takes it from ``REACTOR_DIST_JOIN_SECRET``.
    """

    address: str = "127.0.0.1"
    port: int = 0
    secret_file: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.address, str) or not self.address:
            raise ValueError(f"External(address=...) must be an address to bind, e.g. "
                             f"'127.0.0.1', got {self.address!r}")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or \
                not 0 <= self.port < 65536:
            raise ValueError(f"External(port=...) must be a TCP port (0: a free one), "
                             f"got {self.port!r}")


def check_external(spares: int, launch_prefix: Sequence[str], worker: str) -> None:
    """What a runner whose ranks join cannot do: start a spare or wrap a rank's command
    (the launcher starts them), or name a worker class a joined rank cannot import."""
    if spares:
        raise ValueError("spares= needs a placement that starts processes ('local' or "
                         "'ray'): with placement='external' the launcher starts every rank "
                         "(and a replacement: torchrun's --max-restarts, Slurm's requeue)")
    if launch_prefix:
        raise ValueError("launch_prefix= does not apply with placement='external': the "
                         "launcher starts the ranks; wrap the join command there instead")
    if worker.startswith("__main__:"):
        raise ValueError("with placement='external' the worker class must live in a module "
                         "the ranks import by name (the join command's --worker module:Class),"
                         " not in the script that runs as __main__")


class JoinedRank(Rank):
    """The runner's handle on a rank whose joiner said hello: answered through the join
    socket (its group's thread sends; any thread may ask)."""

    def __init__(self, group: ExternalGroup, identity: bytes, hello: dict[str, Any]) -> None:
        self.group, self.identity = group, identity
        self.rank = int(hello["rank"])
        self.hostname = str(hello.get("host", ""))
        self.joiner_pid = int(hello.get("pid", 0))
        self.address = str(hello.get("address", ""))
        self.local_rank = int(hello.get("local_rank", 0))
        self.port = int(hello.get("port", 0))  # a free port on its node (MASTER_PORT)
        self.shared = False  # it maps this machine's /dev/shm (the group reads its probe)
        self.pid = 0  # its rank's process, on its node, once started
        self.heard = time.monotonic()
        self.report: str | None = None  # its crash report, once dead (or ended)
        self.returncode: int | None = None
        self.lines: list[str] = []
        self.started, self.ended = threading.Event(), threading.Event()
        self._stopped, self._stopped_asked = False, 0.0
        self._stacks: dict[int, JoinedStacks] = {}  # asked, not answered yet

    @property
    def launcher_pid(self) -> int:
        return self.pid

    def where(self) -> str:
        """"pid P on host H", for the messages that name it."""
        return f"pid {self.pid or self.joiner_pid} on {self.hostname or 'an unnamed host'}"

    def died(self, report: str, returncode: int | None, lines: Sequence[str]) -> None:
        if self.report is None:
            self.report, self.returncode, self.lines = report, returncode, list(lines)
        self.started.set()
        self.ended.set()
        for asked in self._stacks.values():  # no answer will come
            asked.done.set()

    def alive(self) -> bool:
        return self.report is None

    def poll(self) -> int | None:
        return self.returncode

    def stopped(self) -> bool:
        """What its joiner said the last time it was asked (at most STOPPED_EVERY s ago;
        never waited for)."""
        now = time.monotonic()
        if now - self._stopped_asked >= STOPPED_EVERY and self.alive():
            self._stopped_asked = now
            self.group.send(self, {JOIN_KIND: Join.STOPPED})
        return self._stopped and self.alive()

    def signal(self, sig: int, group: bool = True) -> None:
        if self.alive():
            self.group.send(self, {JOIN_KIND: Join.SIGNAL, "sig": int(sig), "group": group})

    def report_lines(self) -> list[str]:
        return list(self.lines)

    def crash_report(self) -> str:
        return self.report or f"rank {self.rank} ({self.where()}) still running"

    def stacks_later(self) -> JoinedStacks:
        asked = JoinedStacks(self)
        self._stacks[asked.ident] = asked
        self.group.send(self, {JOIN_KIND: Join.STACKS, "id": asked.ident})
        return asked

    def answered_stacks(self, ident: int, text: str) -> None:
        asked = self._stacks.pop(ident, None)
        if asked is not None:
            asked.text_box.append(text)
            asked.done.set()

    def watch_with(self, deaths: DeathWatch) -> None:
        deaths.watched_elsewhere(self)  # the group's thread calls deaths.notice

    def runs_in(self, pid: int, deaths: DeathWatch) -> None:
        """Nothing to watch from here: its joiner watches the process it started."""

    @classmethod
    def end_all(cls, ranks: Sequence[Rank], grace: float, term_grace: float) -> None:
        """Each joiner ends its rank (``grace`` to leave by itself, then SIGTERM, SIGKILL
        after ``term_grace``) and exits, side by side; a joiner that does not say so in
        time counts as gone."""
        joined = [r for r in cast("list[JoinedRank]", list(ranks)) if r.alive()]
        for r in joined:
            r.group.send(r, {JOIN_KIND: Join.END, "grace": grace, "term_grace": term_grace,
                             "code": 0 if r.group.closing.is_set() else 1})
        deadline = time.monotonic() + timeouts.for_library(grace) + term_grace + END_SLACK
        for r in joined:
            r.ended.wait(max(deadline - time.monotonic(), 0.0))
            r.died(f"rank {r.rank} ({r.where()}) ended by its runner", None, [])


class JoinedStacks:
    """A joined rank's stacks on their way (its joiner's answer)."""

    _idents = itertools.count(1)

    def __init__(self, handle: JoinedRank) -> None:
        self.ident, self.handle = next(JoinedStacks._idents), handle
        self.done, self.text_box = threading.Event(), []

    def text(self) -> str:
        self.done.wait(STACKS_WITHIN)
        if self.text_box:
            return self.text_box[0]
        why = "is gone" if not self.handle.alive() else \
            f"did not send them within {STACKS_WITHIN:g} s"
        return f"rank {self.handle.rank} ({self.handle.where()}): no stacks (its joiner {why})"


class ExternalGroup(Placement):
    """placement="external": the join socket, its thread and the joined ranks of one
    runner."""

    def __init__(self, world_size: int, spec: External, worker: str,
                 start_timeout: float | None) -> None:
        self.world_size, self.spec, self.worker = world_size, spec, worker
        self.start_timeout = start_timeout
        self.joined: dict[int, JoinedRank] = {}  # each rank's handle, once welcomed
        self.waiting: dict[int, JoinedRank] = {}  # said hello, not welcomed yet
        self.wanted: set[int] = set()  # the ranks start() or restart() waits for
        self.changed = threading.Condition()
        self.outbox: queue.SimpleQueue[tuple[bytes, dict[str, Any]]] = queue.SimpleQueue()
        self.closing = threading.Event()
        self.deaths: DeathWatch | None = None
        self.join_public, self.join_secret = zmq.curve_keypair()
        self.address = ""  # the join socket's endpoint, once bound
        self.secret_path = ""
        self.private_dir = ""  # the runner's (the bus's ipc directory), once started
        self.bus_fields: dict[str, Any] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    # -- what the runner shows --------------------------------------------------------
    @property
    def join_command(self) -> str:
        """The command that starts one rank (under torchrun: ``torchrun ... -m
        reactor_dist.rank --join ...``); "" until start() bound the join socket."""
        if not self.address:
            return ""
        return (f"reactor-dist-rank --join {self.address} --worker {self.worker} "
                f"--secret-file {self.secret_path}")

    # -- the placement's interface ----------------------------------------------------
    @property
    def shares_memory(self) -> bool:
        """Every joined rank maps this machine's /dev/shm (its hello's probe said so)."""
        return bool(self.joined) and all(r.shared for r in self.joined.values())

    def bootstrap_fields(self, rank: int) -> dict[str, Any]:
        """The bus over TCP (CurveZMQ), the group's store at rank 0's node, the GPU of
        its local rank; the joiner fills in its keys, its pid and its sys.path."""
        joined = self.joined[rank]
        return dict(self.bus_fields, shared_memory=joined.shared,
                    master_addr=self.store_address(), device_index=joined.local_rank,
                    log_levels=None, spare_addr="")

    def store_address(self) -> str:
        master = self.joined.get(0)
        return master.address if master is not None else ""

    def start(self, ranks: Ranks, bootstrap: Callable[[int], Bootstrap], bus: Bus,
              deadline: float) -> None:
        """Bind, print the join command, and wait until every rank joined and started."""
        cmd, reply, _, server = bus.open_tcp(self.spec.address, {self.join_public})
        self.bus_fields = {"cmd_addr": cmd, "reply_addr": reply,
                           "curve": (server, b"", b"")}
        sock = bus.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a joiner gone: EHOSTUNREACH, not a hang
        self.address = bus.bind_secure(sock, self.spec.address, self.spec.port)
        self.private_dir = os.path.dirname(bus.cmd_addr.removeprefix("ipc://"))
        self.secret_path = self._write_secret(join_secret(server, self.join_secret))
        self.deaths = ranks.watch
        self._thread = threading.Thread(target=self._serve, args=(sock,), daemon=True,
                                        name="reactor-dist-join")
        self._thread.start()
        print(f"reactor_dist: waiting for {self.world_size} rank"
              f"{'s' * (self.world_size > 1)} to join; start each with\n"
              f"    {self.join_command}\n"
              f"  (under torchrun: torchrun ... -m reactor_dist.rank --join ...; the "
              f"secret may come from ${JOIN_SECRET_ENV} instead)", file=sys.stderr, flush=True)
        self._welcome(set(range(self.world_size)), bootstrap, deadline, "start()")
        for rank in range(self.world_size):
            ranks.add(self.joined[rank])

    def restart(self, replaced: list[int], old: Ranks, ranks: Ranks,
                bootstrap: Callable[[int], Bootstrap]) -> None:
        """The ``replaced`` ranks' joiners were told to end (their launcher starts them
        again): wait for the new ones, up to start_timeout; the others keep their
        handles."""
        self.deaths = ranks.watch
        deadline = timeouts.deadline_of(self.start_timeout)
        self._welcome(set(replaced), bootstrap, deadline, "restart()")
        for rank in range(self.world_size):
            ranks.add(self.joined[rank] if rank in replaced else old.procs[rank])

    def start_spare(self, slot: int, place: int, bootstrap: Bootstrap, label: str) -> Rank:
        check_external(1, [], self.worker)  # raises: refused at construction already
        raise RuntimeError  # not reached

    def close(self, ranks: Ranks, grace: float) -> None:
        """Each joiner ends its rank and exits 0; those still waiting are told no; the
        join socket's thread ends; the secret file goes."""
        self.closing.set()
        try:
            ranks.end(grace)
        finally:
            with self.changed:
                for waiting in self.waiting.values():
                    self.send(waiting, {JOIN_KIND: Join.REFUSED,
                                        "why": "the runner shut down"})
                self.waiting = {}
            if self._thread is not None:
                time.sleep(2 * POLL_MS / 1000)  # the refusals leave first
                self._stop.set()
                self._thread.join(timeout=5.0)
                self._thread = None
            if self.secret_path:
                with contextlib.suppress(OSError):
                    os.unlink(self.secret_path)

    # -- joining ----------------------------------------------------------------------
    def _welcome(self, ranks: set[int], bootstrap: Callable[[int], Bootstrap],
                 deadline: float, what: str) -> None:
        """Wait until each of ``ranks`` said hello, then welcome them all (their
        bootstraps name rank 0's address) and wait until they started."""
        with self.changed:
            self.wanted = set(ranks)
            while not ranks <= self.waiting.keys():
                left = deadline - time.monotonic()
                if left <= 0 or self.closing.is_set():
                    self.wanted = set()
                    raise PlacementFailed(self._missing(ranks, what))
                self.changed.wait(min(left, 0.1))
            for rank in ranks:
                self.joined[rank] = self.waiting.pop(rank)
            self.wanted = set()
        for rank in sorted(ranks):
            joined = self.joined[rank]
            local = [r for r in self.joined.values() if r.hostname == joined.hostname]
            env = torchrun_env(rank, self.world_size, self.joined[0].port,
                               self.store_address(), (joined.local_rank, len(local)))
            self.send(joined, {JOIN_KIND: Join.WELCOME, "torch_env": env,
                               "bootstrap": bootstrap(rank).to_bytes(),
                               "private_dir": self.private_dir if joined.shared else ""})
        for rank in sorted(ranks):
            joined = self.joined[rank]
            while not joined.started.wait(timeouts.slice_of(deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    break
            if not joined.started.is_set():
                raise PlacementFailed(f"rank {rank} ({joined.where()}) joined but did not "
                                      f"start its rank process during {what}")

    def _missing(self, ranks: set[int], what: str) -> str:
        missing = sorted(ranks - self.waiting.keys())
        joined = [f"rank {r.rank} from {r.hostname} (pid {r.joiner_pid})"
                  for r in sorted(self.waiting.values(), key=lambda r: r.rank)]
        why = "the runner shut down" if self.closing.is_set() else \
            f"within start_timeout={self.start_timeout:g} s"
        return (f"rank{'s' * (len(missing) > 1)} {', '.join(map(str, missing))} did not "
                f"join {why} during {what} (joined: {', '.join(joined) or 'none'}); start "
                f"each with: {self.join_command}")

    def _write_secret(self, text: str) -> str:
        path = self.spec.secret_file or os.path.join(self.private_dir, "join-secret")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            os.fchmod(fd, 0o600)  # a file there before keeps its mode otherwise
            os.write(fd, text.encode() + b"\n")
        finally:
            os.close(fd)
        return os.path.abspath(path)

    def send(self, joined: JoinedRank, message: dict[str, Any]) -> None:
        """Queue ``message`` for ``joined``'s joiner: the group's thread sends it."""
        self.outbox.put((joined.identity, message))

    def refusal(self, hello: dict[str, Any]) -> str | None:
        """Why a hello is refused, or None."""
        if hello.get("version") != __version__ or hello.get("wire") != WIRE_VERSION:
            return (f"this rank runs reactor_dist {hello.get('version')} (wire "
                    f"{hello.get('wire')}), the runner {__version__} (wire {WIRE_VERSION}): "
                    f"install the same version on both")
        if hello.get("worker") != self.worker:
            return (f"this rank's worker is {hello.get('worker')!r}, the runner's "
                    f"{self.worker!r}: join with --worker {self.worker}")
        rank, size = hello.get("rank"), hello.get("world_size")
        if size is not None and size != self.world_size:
            return f"this rank was started for world size {size}, the runner's is " \
                   f"{self.world_size}"
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            return f"rank {rank!r} is out of range: the runner's ranks are 0 to " \
                   f"{self.world_size - 1}"
        if self.closing.is_set():
            return "the runner is shutting down"
        held = self.waiting.get(rank) or self.joined.get(rank)
        if held is not None and held.alive() and (rank in self.waiting or
                                                   rank not in self.wanted):
            return f"rank {rank} is taken: it joined from {held.hostname} (pid " \
                   f"{held.joiner_pid}) and runs"
        return None

    # -- the join socket's thread -----------------------------------------------------
    def _serve(self, sock: zmq.Socket) -> None:
        beat = last = time.monotonic()
        try:
            while not self._stop.is_set():
                wait_ms = POLL_MS
                while sock.poll(wait_ms):  # every message that came, before any judging
                    wait_ms = 0
                    frames = sock.recv_multipart()
                    if len(frames) == 2:
                        self._received(frames[0], frames[1])
                while not self.outbox.empty():
                    self._deliver(sock, *self.outbox.get())
                now = time.monotonic()
                if now - last > JOIN_SILENCE / 2:
                    # This thread itself got no turn for a while (the application held
                    # the GIL, the machine was starved): what it did not hear meanwhile
                    # says nothing of the joiners.
                    with self.changed:
                        for joined in (*self.waiting.values(), *self.joined.values()):
                            joined.heard = max(joined.heard, now - JOIN_BEAT_EVERY)
                last = now
                if now - beat >= JOIN_BEAT_EVERY:
                    beat = now
                    self._beat(sock, now)
        finally:
            sock.close(linger=0)

    def _deliver(self, sock: zmq.Socket, identity: bytes, message: dict[str, Any]) -> None:
        with contextlib.suppress(zmq.ZMQError):  # gone: its silence tells
            sock.send_multipart([identity, msgpack.packb(message, use_bin_type=True)],
                                flags=zmq.NOBLOCK)

    def _beat(self, sock: zmq.Socket, now: float) -> None:
        with self.changed:
            peers = [*self.waiting.values(), *self.joined.values()]
            for joined in peers:
                if not joined.alive():
                    continue
                if now - joined.heard > JOIN_SILENCE:
                    self._gone(joined, f"rank {joined.rank} ({joined.where()}): its joiner "
                                       f"fell silent for {JOIN_SILENCE:g} s (killed, stopped,"
                                       f" or its machine or network is gone)")
                    continue
                try:
                    sock.send_multipart([joined.identity, BEAT], flags=zmq.NOBLOCK)
                except zmq.ZMQError as exc:
                    if exc.errno == zmq.EHOSTUNREACH:  # its connection closed: it died
                        self._gone(joined, f"rank {joined.rank} ({joined.where()}): its "
                                           f"joiner's connection closed (it died)")
            self.waiting = {r: j for r, j in self.waiting.items() if j.alive()}

    def _gone(self, joined: JoinedRank, report: str, returncode: int | None = None,
              lines: Sequence[str] = ()) -> None:
        known = joined.alive()
        joined.died(report, returncode, lines)
        welcomed = self.joined.get(joined.rank) is joined
        if known and welcomed and self.deaths is not None and not self.closing.is_set():
            self.deaths.notice([joined.rank])

    def _received(self, identity: bytes, data: bytes) -> None:
        try:
            message = msgpack.unpackb(data, raw=False)
            kind = message[JOIN_KIND]
            with self.changed:
                self._handle(identity, kind, message)
        except (msgpack.UnpackException, ValueError, TypeError, KeyError, AttributeError):
            # Not msgpack, not a map, or a field of the wrong type: an authenticated peer
            # of another version, say.  Never the end of this thread.
            log.warning("dropped a message on the join socket that is not a join message")

    def _handle(self, identity: bytes, kind: Any, message: dict[str, Any]) -> None:
        """Under ``changed``: one message from a joiner."""
        if kind == Join.HELLO:
            self._hello(identity, message)
            return
        joined = next((j for j in (*self.waiting.values(), *self.joined.values())
                       if j.identity == identity), None)
        if joined is None:
            return  # a joiner refused, or ended: nothing of ours
        joined.heard = time.monotonic()
        if kind == Join.STARTED:
            joined.pid = int(message.get("pid", 0))
            joined.started.set()
        elif kind == Join.DIED:
            self._gone(joined, str(message.get("report", "")), message.get("returncode"),
                       [str(line) for line in message.get("lines", [])])
        elif kind == Join.ENDED:
            joined.ended.set()
        elif kind == Join.STOPPED:
            joined._stopped = bool(message.get("value"))
        elif kind == Join.STACKS:
            joined.answered_stacks(int(message.get("id", 0)), str(message.get("text", "")))

    def _hello(self, identity: bytes, hello: dict[str, Any]) -> None:
        why = self.refusal(hello)
        if why is not None:
            log.warning("refused a rank's join from %s (pid %s): %s", hello.get("host"),
                        hello.get("pid"), why)
            self.outbox.put((identity, {JOIN_KIND: Join.REFUSED, "why": why}))
            return
        joined = JoinedRank(self, identity, hello)
        joined.shared = _probe_matches(hello.get("probe"))
        self.waiting[joined.rank] = joined
        log.info("rank %d joined from %s (pid %d)%s", joined.rank, joined.hostname,
                 joined.joiner_pid, "" if joined.shared else ": no shared memory with it, "
                 "its payloads travel over TCP")
        self.changed.notify_all()


def _probe_matches(probe: Any) -> bool:
    """The joiner's /dev/shm file reads the same here: the rank shares our memory."""
    if not isinstance(probe, (list, tuple)) or len(probe) != 2:
        return False
    name, content = probe
    if not isinstance(name, str) or "/" in name or not isinstance(content, bytes):
        return False
    try:
        with open(os.path.join("/dev/shm", name), "rb") as f:
            return f.read(64) == content
    except OSError:
        return False
