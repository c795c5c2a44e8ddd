"""The one place tests look inside a runner: the pids, names and paths that no public
API gives, and which the process, cleanup and trust tests must check.

No other test module reaches a private name of reactor_dist (tests/test_seams.py
enforces it): what a test needs from inside is a small documented member here, so that
a change inside the library shows up in one file."""

from __future__ import annotations

import psutil
import zmq

from reactor_dist import DistributedRunner, DistributedWorker
from reactor_dist.caller.bus import Bus
from reactor_dist.placement.template import Template
from reactor_dist.rank.memory import RankMemory
from reactor_dist.wire.protocol import MARK_ENV, TEMPLATE_NAME


def marked_by(runner_pid: int) -> list[psutil.Process]:
    """Every live process started by the ranks of the runners in process ``runner_pid``
    (the ranks too): they carry its mark (local.RankProcess.mark) in their
    environment, also after they left the rank's session or were reparented.  A rank
    forked from a template (reactor_dist.placement.template) shows the template's environment,
    which carries the runner's pid; the template itself, which serves every runner of
    the process for as long as the process lives, is not counted."""
    found = []
    for p in psutil.process_iter():
        try:
            if (p.environ().get(MARK_ENV, "").startswith(f"{runner_pid}-")
                    and p.name() != TEMPLATE_NAME):
                found.append(p)
        except psutil.Error:
            pass
    return found


def rank_memory_of(worker: DistributedWorker) -> RankMemory:
    """Inside a rank: the rank's shared memory (reactor_dist.rank.memory), whose staging
    counters (``result_staging.staged``, ``input_staging.fast``) say which path a tensor
    or an input took."""
    return worker._reactor_to_device.__self__


class Probe:
    def __init__(self, runner: DistributedRunner) -> None:
        self._supervisor = runner._supervisor
        self._queue = runner._queue

    @property
    def engine(self):
        """The runner's engine (reactor_dist.caller.engine.Engine): its state machine."""
        return self._queue.engine

    @property
    def reply_descriptor(self) -> int:
        """The reply socket's descriptor, which an event loop's reader watches while a
        task awaits a call (call_queue.CallQueue.add_waker)."""
        return self._supervisor.bus.pull_fd

    @property
    def shares_memory(self) -> bool:
        """Every rank maps this machine's /dev/shm: payloads go through it (else in-band)."""
        return self._supervisor.placement.shares_memory

    @property
    def rank_pids(self) -> list[int]:
        """The ranks' process ids (the processes the runner started); [] once ended."""
        ranks = self._supervisor.ranks
        return [p.pid for p in ranks.procs] if ranks is not None else []

    @property
    def ready_spare_pids(self) -> list[int]:
        """The pids of the spares loaded and waiting (spares.Spares), oldest first."""
        with self._supervisor.spares.lock:
            return [s.proc.pid for s in self._supervisor.spares.spares
                    if s.ready and s.proc.alive()]

    @property
    def placed_spares(self) -> list[dict]:
        """placement="ray": each spare's slot, node id, whether it shares this node, its
        pid and its host actor's pid, oldest first."""
        with self._supervisor.spares.lock:
            return [{"slot": s.slot, "node": s.proc.node, "local": s.proc.local,
                     "pid": s.proc.pid, "host_pid": s.proc.host_pid, "ready": s.ready}
                    for s in self._supervisor.spares.spares]

    @property
    def launcher_pids(self) -> list[int]:
        """Where each rank's code runs (differs from rank_pids under a wrapping prefix)."""
        ranks = self._supervisor.ranks
        return [p.launcher_pid for p in ranks.procs] if ranks is not None else []

    @property
    def rank_processes(self) -> list:
        """The ranks' local.RankProcess handles: their ``popen.returncode`` (the exit
        status) stays readable after shutdown(); [] once ended."""
        ranks = self._supervisor.ranks
        return list(ranks.procs) if ranks is not None else []

    def output_lines(self, rank: int) -> list[str]:
        """The last lines rank ``rank`` wrote, as its output pump kept them (also the
        lines it did not forward)."""
        return self._supervisor.ranks.procs[rank].output.last_lines(200)

    def processes(self) -> list[int]:
        """Every rank and every process under it."""
        pids = []
        for pid in self.rank_pids:
            pids.append(pid)
            try:
                pids.extend(p.pid for p in psutil.Process(pid).children(recursive=True))
            except psutil.Error:
                pass
        return pids

    @property
    def shm_prefix(self) -> str:
        """The prefix of this runner's /dev/shm entries (without the trailing dot)."""
        return self._supervisor.shm_prefix

    @property
    def ipc_dir(self) -> str | None:
        """The runner's private directory of ipc:// endpoints (``ipc://{ipc_dir}/reply``
        is the reply socket's)."""
        return self._supervisor.ipc_dir

    @property
    def secret(self) -> bytes:
        """The per-runner secret every message is signed with (framing.Channel(secret))."""
        return self._supervisor.secret

    @property
    def bus(self) -> Bus:
        """The runner's two ZeroMQ sockets (bus.Bus): to publish a command the runner
        would not send, or to read replies past the call queue."""
        return self._supervisor.bus

    @property
    def releaser_wake_fd(self) -> int:
        """The file descriptor number of the releaser's wake pipe (its write end): closed
        at shutdown, after which nothing may write to that number again."""
        return self._supervisor.releaser._write

    def cut_a_command_short(self) -> None:
        """Leave the command socket as a Ctrl-C in the middle of a send leaves it."""
        bus = self._supervisor.bus
        bus.pub.send(b"half of an interrupted command", zmq.SNDMORE)
        bus._pub_open = True

    @property
    def placed(self) -> list[dict]:
        """placement="ray": each rank's node id, whether it shares this node, its pid
        and its host actor's pid (on its node); [] once shut down."""
        group = self._supervisor.placement  # a ray_group.RayGroup
        return [{"rank": h.rank, "node": h.node, "local": h.local, "pid": h.pid,
                 "host_pid": h.host_pid} for h in group.ranks]

    def signal_rank(self, rank: int, sig: int) -> None:
        """``sig`` to rank ``rank``'s process group through its handle
        (base.Rank.signal), wherever the rank runs."""
        self._supervisor.ranks.procs[rank].signal(sig)

    @property
    def tcp_endpoints(self) -> list[str]:
        """The bus's TCP endpoints (ranks on other nodes), [] when every rank is local."""
        bus = self._supervisor.bus
        return [sock.getsockopt(zmq.LAST_ENDPOINT).decode() for sock in (bus.pub, bus.pull)
                if sock.getsockopt(zmq.LAST_ENDPOINT).startswith(b"tcp://")]

    @property
    def server_key(self) -> bytes:
        """The CurveZMQ public key of the bus's TCP endpoints."""
        return self._supervisor.bus.server_key

    @property
    def lifeline_address(self) -> tuple[str, int]:
        """placement="ray": where the runner listens for its hosts' lifelines."""
        return self._supervisor.placement.lifeline.getsockname()[:2]

    def cut_lifelines(self) -> None:
        """Close the runner's end of every host's lifeline (as its death would)."""
        group = self._supervisor.placement
        for sock in group._held:
            sock.close()


def rank_templates() -> list:
    """This process's rank templates (reactor_dist.placement.template.Template), each with its
    ``process`` (a Popen) and ``orphans`` (the pids of the ranks forked for an
    interrupted request and not yet reaped)."""
    return list(Template._kept.values())


def interrupt_a_fork_reply(monkeypatch) -> None:
    """The next fork's wait for its reply raises KeyboardInterrupt, once, after its
    request was sent: what a Ctrl-C at that moment does."""
    receive = Template._receive

    def interrupted(self, timeout):
        monkeypatch.setattr(Template, "_receive", receive)
        raise KeyboardInterrupt

    monkeypatch.setattr(Template, "_receive", interrupted)
