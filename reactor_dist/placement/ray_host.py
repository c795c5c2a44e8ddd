"""The Ray actor that runs one rank on the node Ray placed it on.

Ray places; it does not run the rank.  Each bundle of the runner's placement group
holds one :class:`RankHost`, which starts the same ``python -P -m reactor_dist.rank``
as a local runner does (:class:`reactor_dist.placement.local.RankProcess`: own process group,
bootstrap on stdin, output pump, pidfd death watch) and answers the runner::

    runner                                RankHost (one per rank, on its node)
    where()        -------------------->  node id, pid, curve public key
    launch(boot)   -------------------->  spawn the rank; the client secret key is
                                          added to its bootstrap here, never sent
    exited()       ----- blocks ------->  returns the crash report, the exit status
                                          and the last lines when it dies
    stacks()       -------------------->  SIGUSR1 -> faulthandler dump lines
    signal(sig)    -------------------->  sig to the rank's process group
    stopped()      -------------------->  whether the rank is stopped (state T or t)
    relaunch(boot) -------------------->  what is left ends; the rank (or a spare)
                                          starts again
    become(rank)   -------------------->  the spare here is that rank from now on
    end_rank()     -------------------->  graceful wait, then kill the group; host stays
    stop(grace)    -------------------->  the same, and the lifeline closed

Why a host process rather than the rank being the actor: the rank keeps one code
path wherever it runs (its signals, its process group, its stdin bootstrap, its
faulthandler), Ray's own threads and signal handling stay out of the
model's process, and killing a rank's whole group is ours to do, not Ray's.

Two watches end a rank whose runner is gone: the rank watches this host's pid (as a
local rank watches its runner), and Ray kills the host when its owner, the runner's
process, dies; on top, the host holds a TCP *lifeline* to the runner and ends the
rank and itself the moment it breaks (keepalive finds a dead node within seconds).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import threading

import zmq

from ..wire.protocol import Bootstrap
from .base import TERM_GRACE, Ranks
from .local import RankProcess
from .ray_view import gpu_view, set_rank_threads

KEEPALIVE = (1, 1, 3)  # idle s, interval s, probes: a silent dead peer found in ~4 s


class RankHost:
    """One rank's process on this node (used as a Ray actor, max_concurrency > 1)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.died = threading.Event()
        # The rank's lines, [rank N]-prefixed, on this actor's stderr: Ray forwards them
        # to the runner's process (log_to_driver); crash reports and stacks keep the last.
        self.ranks = Ranks(lambda ranks: self.died.set())
        self._public, self._secret = zmq.curve_keypair()
        self._lifeline: socket.socket | None = None
        self._launched: tuple[dict[str, str], list[str], dict[str, str]] = ({}, [], {})

    def where(self) -> tuple[str, int, bytes, list[str], str | None]:
        """(Ray node id, this host's pid, the rank's CurveZMQ public key, the GPU ids Ray
        gave it, the CUDA_VISIBLE_DEVICES it sees)."""
        import ray

        return (ray.get_runtime_context().get_node_id(), os.getpid(), self._public,
                *gpu_view())

    def free_port(self, address: str) -> int:
        """A free TCP port at ``address`` on this node (MASTER_PORT)."""
        with socket.socket() as s:
            s.bind((address, 0))
            return s.getsockname()[1]

    def launch(self, bootstrap: bytes, env: dict[str, str], launch_prefix: list[str],
               torch_env: dict[str, str], lifeline: tuple[str, int] | None,
               threads: str | None = None, label: str = "") -> int:
        """Start the rank (a spare: ``label`` names it); its pid.  ``lifeline``: the
        runner's address to hold on to; ``threads``: the runner's OMP_NUM_THREADS (the
        rank's, not Ray's)."""
        if lifeline is not None:  # first: a runner already gone gets no rank started
            self._hold(lifeline)
        set_rank_threads(threads)
        self._launched = (env, launch_prefix, torch_env)
        return self._spawn(bootstrap, label)

    def _spawn(self, bootstrap: bytes, label: str = "") -> int:
        boot = Bootstrap.read_bytes(bootstrap)
        if boot.curve is not None:  # the secret key is born here and stays here
            boot = dataclasses.replace(boot, curve=(boot.curve[0], self._public, self._secret))
        env, launch_prefix, torch_env = self._launched
        proc = RankProcess.spawn(self.rank, self.world_size, boot.to_bytes(), master_port=0,
                                 env=env, gpus=None, launch_prefix=launch_prefix,
                                 torch_env=torch_env, label=label)
        self.ranks.add(proc)
        return proc.pid

    def relaunch(self, bootstrap: bytes, torch_env: dict[str, str] | None = None,
                 label: str = "") -> int:
        """restart(): whatever is left of the rank ends; the rank (or a spare: ``label``)
        starts again here (same node, same bundle, same GPUs; ``torch_env``: its
        torchrun environment where it is not the last one's); its pid."""
        self.end_rank()
        died = self.died = threading.Event()
        self.ranks = Ranks(lambda ranks: died.set())
        if torch_env is not None:
            env, launch_prefix, _ = self._launched
            self._launched = (env, launch_prefix, torch_env)
        return self._spawn(bootstrap, label)

    def become(self, rank: int) -> None:
        """The spare here took rank ``rank``'s place: reports and lines name that rank."""
        self.rank = rank
        for proc in self.ranks.procs:
            proc.become(rank)

    def end_rank(self, grace: float = 0.0, term_grace: float = TERM_GRACE) -> None:
        """The rank ends (a restart replaces it, or failed; or the runner shuts down):
        ``grace`` seconds to leave by itself, then its group ended for sure, SIGTERM then
        SIGKILL after ``term_grace`` seconds (base.Ranks.end); the host stays."""
        self.ranks.end(grace, term_grace)
        self.died.set()  # a watch still waiting on it learns that it is gone

    def _hold(self, address: tuple[str, int]) -> None:
        sock = socket.create_connection(address, timeout=10)
        sock.settimeout(None)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        idle, interval, probes = KEEPALIVE
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, interval)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, probes)
        self._lifeline = sock

        def hold() -> None:
            with contextlib.suppress(OSError):
                while sock.recv(64):
                    pass
            if self._lifeline is sock:  # broken, not closed by stop(): the runner is gone
                RankProcess.end_all(self.ranks.procs, 0.0, term_grace=0.5)
                os._exit(1)

        threading.Thread(target=hold, name="reactor-dist-lifeline", daemon=True).start()

    def exited(self) -> tuple[str, int | None, list[str]]:
        """Blocks until the rank dies; its crash report, its exit code (negative: the
        signal) and the report's lines, the last two for its failure record
        (errors.RankFailure)."""
        ranks, died = self.ranks, self.died  # this rank's, not a relaunched one's
        died.wait()
        if not ranks.procs:  # ended on purpose (end_rank): gone, and nobody is told
            return f"rank {self.rank} ended by its runner", None, []
        proc = ranks.procs[0]
        return proc.crash_report(), proc.poll(), proc.report_lines()

    def signal(self, sig: int, group: bool = True) -> None:
        """``sig`` to the rank's process group, or (``group`` false) to its own process
        alone (local.RankProcess.signal)."""
        for proc in self.ranks.procs:
            proc.signal(sig, group)

    def stopped(self) -> bool:
        """The rank (or spare) here is stopped (state T or t): it cannot read its
        commands, and its full pipe would hold up every rank's (base.Rank.stopped)."""
        return any(proc.stopped() for proc in self.ranks.procs)

    def stacks(self) -> str:
        """Every thread's stack of the rank (faulthandler), as Ranks.stacks shows them."""
        return self.ranks.stacks([0])

    def stop(self, grace: float) -> None:
        """Give the rank ``grace`` seconds to exit, then end its group for sure."""
        lifeline, self._lifeline = self._lifeline, None
        self.ranks.end(grace)
        if lifeline is not None:
            with contextlib.suppress(OSError):  # ends hold()'s recv (a close would not)
                lifeline.shutdown(socket.SHUT_RDWR)
            lifeline.close()
