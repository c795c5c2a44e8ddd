"""Ranks placed by Ray across nodes (``DistributedRunner(..., placement="ray")``).

Ray reserves and places; the rest is the local runner's::

    reserve()   a placement group of world_size bundles (rank i in bundle i); bundle 0
                pinned to the caller's node (label ray.io/node-id) where it has room
    hosts       one RankHost actor per bundle (reactor_dist.host): where() -> node id,
                pid, the rank's CurveZMQ public key; a node's address is the one Ray
                reports for it (ray.nodes()), never a guess at the machine's
    bus         ranks on the caller's node: ipc:// and /dev/shm, as locally; ranks on
                other nodes: the runner's sockets on TCP at its node's address, CurveZMQ
                with only the hosts' keys admitted, payloads in-band, the group's store
                a TCPStore on rank 0's node
    launch()    each host starts its rank (same rank code, same bootstrap)
    watch       a thread waits on every host's exited(): a rank's death (or its host's,
                or its node's) is a death notice like a local one
    lifeline    each host holds a TCP connection to the runner: broken, it ends its rank

Locality is decided by Ray's node id alone, never by trying shared memory.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import PlacementFailed, WorkerTimeout
from .host import RankHost
from .protocol import Bootstrap, torchrun_env
from .ray_view import THREADS_ENV, check_own_gpus, connect, local_place

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
RAY_EXTRA = "pip install 'reactor-dist[ray]'"
NODE_LABEL = "ray.io/node-id"
PIN_WAIT = 2.0  # seconds a group with rank 0 pinned to the caller's node may take
log = logging.getLogger("reactor_dist")


def import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise ImportError(f"placement='ray' needs Ray, which is not installed: {RAY_EXTRA}"
                          ) from exc
    return ray


@dataclass
class RaySpec:
    """The runner's Ray options, checked at construction."""

    bundle: dict[str, float] | None
    strategy: str


def check_ray_options(placement: str, bundle: Any, strategy: Any) -> RaySpec | None:
    if placement not in ("local", "ray"):
        raise ValueError(f"placement must be 'local' or 'ray', got {placement!r}")
    if strategy not in STRATEGIES:
        raise ValueError(f"ray_strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    if bundle is not None:
        if not isinstance(bundle, dict) or not bundle or not all(
                isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
                and v >= 0 for k, v in bundle.items()):
            raise ValueError(f"ray_bundle must be a dict of resource name -> amount >= 0, "
                             f"e.g. {{'GPU': 1}}; got {bundle!r}")
        bundle = {k: float(v) for k, v in bundle.items()}
    if placement == "local":
        return None
    import_ray()
    return RaySpec(bundle, strategy)


class HostedRank:
    """The runner's handle on a rank that a RankHost runs: what Ranks asks of a
    RankProcess (alive, poll, crash_report, report_lines, stacks), answered through Ray."""

    hosted = True

    def __init__(self, rank: int, host: Any, node: str, address: str, host_pid: int,
                 local: bool, hostname: str = "") -> None:
        self.rank, self.host, self.node, self.address = rank, host, node, address
        self.host_pid, self.local, self.hostname = host_pid, local, hostname
        self.pid = 0  # on its node, once launched
        self.report: str | None = None  # its crash report, once dead
        self.returncode: int | None = None  # once dead, as its host saw it (None: unknown)
        self.lines: list[str] = []  # its last lines, once dead (its host keeps them)

    @property
    def launcher_pid(self) -> int:
        """Where its code runs (its host started it: the same pid)."""
        return self.pid

    def died(self, exited: Any) -> None:
        """Its host's ``exited()``: the crash report, exit status and last lines."""
        self.report, self.returncode, self.lines = exited

    def alive(self) -> bool:
        return self.report is None

    def poll(self) -> int | None:
        """The exit code (negative: the signal) once dead; None also where it is not
        known (its host or Ray is gone)."""
        return self.returncode

    def stopped(self) -> bool:
        """Not known here (its host could look): counted as running."""
        return False

    def report_lines(self) -> list[str]:
        return list(self.lines)

    def crash_report(self) -> str:
        return self.report or f"rank {self.rank} (pid {self.pid}) still running"

    def send_signal(self, sig: int) -> None:
        """``sig`` to the rank's own process, through its host (not waited for)."""
        self.host.send_signal.remote(sig)

    def stacks_later(self) -> Any:
        return self.host.stacks.remote()

    def stacks_now(self, later: Any) -> str:
        import ray

        try:
            return ray.get(later, timeout=10)
        except Exception as exc:
            return f"rank {self.rank} (pid {self.pid} on node {self.node[:12]}): " \
                   f"no stacks ({type(exc).__name__}: {exc})"


class RayGroup:
    """The placement group, the hosts and their watch, of one runner."""

    def __init__(self, world_size: int, spec: RaySpec, device: str) -> None:
        self.ray = import_ray()
        self.world_size, self.spec, self.device = world_size, spec, device
        self.group: Any = None
        self.ranks: list[HostedRank] = []
        self.bundle: dict[str, float] = {}
        self.lifeline: socket.socket | None = None
        self._held: list[socket.socket] = []
        self._closing = threading.Event()
        self._watching = threading.Event()  # set: the current watch thread ends
        self._threads: list[threading.Thread] = []  # the lifeline's and the watch's

    # -- reserve ---------------------------------------------------------------------
    def reserve(self, timeout: float, stated: float) -> None:
        """Reserve the bundles and start one host per bundle, within ``timeout`` (what
        is left of start_timeout, ``stated``)."""
        ray = self.ray
        if not ray.is_initialized():
            connect(ray, timeout)
        self.node = ray.get_runtime_context().get_node_id()
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        # Each node's address as Ray reports it (never a guess at this machine's address).
        self.addresses = {n["NodeID"]: n["NodeManagerAddress"] for n in nodes}
        self.hostnames = {n["NodeID"]: n.get("NodeManagerHostname", "") for n in nodes}
        self.address = self.addresses.get(self.node, "127.0.0.1")
        self.bundle = self.spec.bundle or self._default_bundle(nodes)
        self._check_feasible(nodes)
        mine = next((n for n in nodes if n["NodeID"] == self.node), None)
        pin = mine is not None and _fits(mine["Resources"], self.bundle) >= 1
        deadline = time.monotonic() + timeout
        if pin and not self._try_group(pinned=True, wait=min(PIN_WAIT, timeout)):
            log.info("rank 0's bundle finds no room on this node: placing it anywhere "
                     "(its results then travel over TCP)")
        if self.group is None and not self._try_group(
                pinned=False, wait=deadline - time.monotonic()):
            raise PlacementFailed(
                f"Ray could not reserve {self.world_size} bundles of {_fmt(self.bundle)} "
                f"({self.spec.strategy}) within start_timeout={stated:g} s: the cluster "
                f"has {_fmt(ray.cluster_resources())} in all, {_fmt(ray.available_resources())}"
                f" free; nothing was left reserved")
        self._start_hosts(max(deadline - time.monotonic(), 0.01))

    def _default_bundle(self, nodes: list[dict]) -> dict[str, float]:
        gpus = sum(n["Resources"].get("GPU", 0) for n in nodes)
        wants_gpu = self.device == "cuda" or (self.device == "auto" and gpus > 0)
        return {"GPU": 1.0} if wants_gpu else {"CPU": 1.0}

    def _check_feasible(self, nodes: list[dict]) -> None:
        """Fail at once when the cluster's nodes could never hold the bundles."""
        fits = [_fits(n["Resources"], self.bundle) for n in nodes]
        strategy, n = self.spec.strategy, self.world_size
        ok = {"STRICT_PACK": max(fits, default=0) >= n,
              "STRICT_SPREAD": sum(f >= 1 for f in fits) >= n}.get(strategy, sum(fits) >= n)
        if ok:
            return
        total: dict[str, float] = {}
        for node in nodes:
            for key, value in node["Resources"].items():
                total[key] = total.get(key, 0.0) + value
        missing = {k: v * n - total.get(k, 0.0) for k, v in self.bundle.items()
                   if v * n > total.get(k, 0.0)}
        why = f"missing {_fmt(missing)}" if missing else \
            f"{strategy} needs {'one node for all' if strategy == 'STRICT_PACK' else 'a node each'}"
        raise PlacementFailed(
            f"the Ray cluster cannot hold {n} bundles of {_fmt(self.bundle)} ({strategy}): "
            f"{why}; its {len(nodes)} node(s) have {[_fmt(x['Resources']) for x in nodes]}. "
            f"Add nodes, lower world_size or change ray_bundle / ray_strategy")

    def _try_group(self, pinned: bool, wait: float) -> bool:
        from ray.util.placement_group import placement_group, remove_placement_group

        bundles = [dict(self.bundle) for _ in range(self.world_size)]
        selector = [{NODE_LABEL: self.node}] + [{}] * (self.world_size - 1) if pinned else None
        group = self.group = placement_group(  # held here at once: close() removes it
            bundles, strategy=self.spec.strategy, bundle_label_selector=selector)
        ready, _ = self.ray.wait([group.ready()], timeout=max(wait, 0.01))
        if not ready:
            remove_placement_group(group)
            self.group = None
        return bool(ready)

    def _start_hosts(self, timeout: float) -> None:
        ray = self.ray
        from ray.util.placement_group import placement_group_table
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        table = placement_group_table(self.group)["bundles_to_node_id"]
        host_class = ray.remote(RankHost)
        options = {"num_cpus": self.bundle.get("CPU", 0), "num_gpus": self.bundle.get("GPU", 0),
                   "resources": {k: v for k, v in self.bundle.items()
                                 if k not in ("CPU", "GPU", "memory")},
                   "max_concurrency": 4}
        if "memory" in self.bundle:
            options["memory"] = self.bundle["memory"]
        hosts = [host_class.options(**options, scheduling_strategy=PlacementGroupSchedulingStrategy(
            self.group, placement_group_bundle_index=rank)).remote(rank, self.world_size)
                 for rank in range(self.world_size)]
        # Known before anything can fail, so that close() ends whatever started.
        self.ranks = [HostedRank(r, h, table.get(r, "?"), "", 0, False)
                      for r, h in enumerate(hosts)]
        wheres = self._get([h.where.remote() for h in hosts], timeout, "start the ranks' hosts")
        self.ranks = [HostedRank(r, h, node, self.addresses[node], pid, node == self.node,
                                 self.hostnames.get(node, ""))
                      for r, (h, (node, pid, *_)) in enumerate(zip(hosts, wheres, strict=True))]
        self.keys = {r: where[2] for r, where in enumerate(wheres)}
        if self.own_gpus:  # cuda:0 must be each rank's own GPU
            check_own_gpus([(r, node, gpus, visible)
                            for r, (node, _, _, gpus, visible) in enumerate(wheres)])

    @property
    def own_gpus(self) -> bool:
        """Ray assigns each rank GPUs of its own (its CUDA_VISIBLE_DEVICES)."""
        return self.bundle.get("GPU", 0) > 0

    def _get(self, refs: Any, timeout: float, what: str) -> Any:
        """ray.get within what is left of start_timeout (a WorkerTimeout past it)."""
        try:
            return self.ray.get(refs, timeout=max(timeout, 0.01))
        except self.ray.exceptions.GetTimeoutError:
            raise WorkerTimeout(f"Ray did not {what} within the {timeout:g} s left of "
                                f"start_timeout") from None

    # -- launch ---------------------------------------------------------------------
    @property
    def spans_nodes(self) -> bool:
        return not all(r.local for r in self.ranks)

    def remote_keys(self) -> set[bytes]:
        return {self.keys[r.rank] for r in self.ranks if not r.local}

    def launch(self, boots: list[Bootstrap], env: dict[str, str], launch_prefix: list[str],
               timeout: float) -> None:
        """Start every rank through its host (the bootstraps are ready)."""
        master = self.ranks[0]
        # MASTER_PORT for models that form their own group (init_process_group=False).
        deadline = time.monotonic() + timeout
        master_port = self._get(master.host.free_port.remote(master.address), timeout,
                                "reach rank 0's host")
        lifeline = self._open_lifeline()
        calls = []
        nodes = [r.node for r in self.ranks]
        for hosted, boot in zip(self.ranks, boots, strict=True):
            torch_env = torchrun_env(hosted.rank, self.world_size, master_port, master.address,
                                     local_place(hosted.rank, nodes, self.own_gpus))
            calls.append(hosted.host.launch.remote(  # {rank} is filled in by Ranks.spawn
                boot.to_bytes(), env, launch_prefix, torch_env, lifeline,
                os.environ.get(THREADS_ENV)))
        pids = self._get(calls, deadline - time.monotonic(), "start the ranks")
        for hosted, pid in zip(self.ranks, pids, strict=True):
            hosted.pid = pid

    def _open_lifeline(self) -> tuple[str, int]:
        """A TCP listener every host holds a connection to: when this process dies the
        kernel closes it, and the hosts end their ranks and themselves at once, however
        long Ray takes to notice (host.RankHost._hold)."""
        listener = self.lifeline = socket.create_server((self.address, 0), backlog=64)

        def accept() -> None:
            with contextlib.suppress(OSError):  # close(): shut down, accept() fails
                while True:
                    self._held.append(listener.accept()[0])

        self._start_thread(accept, "reactor-dist-lifeline")
        return listener.getsockname()[:2]

    def _start_thread(self, target: Callable[[], None], name: str) -> None:
        """A thread of this group: close() ends and joins it."""
        thread = threading.Thread(target=target, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    def relaunch(self, replaced: list[int], ranks: Any, boots: list[Bootstrap],
                 timeout: float) -> None:
        """restart(): ``replaced`` start again through their hosts, in their bundles
        (``boots``, in that order); ``ranks`` (processes.Ranks) takes every rank's handle
        and the watch reports to it from now on."""
        for hosted in self.ranks:
            ranks.adopt(hosted)
        calls = [self.ranks[r].host.relaunch.remote(boot.to_bytes())
                 for r, boot in zip(replaced, boots, strict=True)]
        try:
            pids = self._get(calls, timeout, "start the replaced ranks again")
        except self.ray.exceptions.RayError as exc:  # a host that is gone (its node?)
            raise PlacementFailed(f"the bundle of rank {', '.join(map(str, replaced))} could "
                                  f"not be placed again: {type(exc).__name__}: {exc}"
                                  ) from exc
        for rank, pid in zip(replaced, pids, strict=True):
            self.ranks[rank].pid, self.ranks[rank].report = pid, None
            self.ranks[rank].returncode, self.ranks[rank].lines = None, []
        self.watch(ranks.watch.notice)

    def end_ranks(self) -> None:
        """A restart failed: every rank ends now; the hosts and bundles stay."""
        with contextlib.suppress(Exception):
            self.ray.wait([r.host.end_rank.remote() for r in self.ranks],
                          num_returns=len(self.ranks), timeout=30)

    def watch(self, notice: Callable[[list[int]], None]) -> None:
        """A thread that reports each rank's death (or its host's) to ``notice``; a new
        watch (after a restart) ends the one before."""
        ray = self.ray
        self._watching.set()
        stop = self._watching = threading.Event()
        waiting = {r.host.exited.remote(): r for r in self.ranks}

        def run() -> None:
            while waiting and not self._closing.is_set() and not stop.is_set():
                try:
                    done, _ = ray.wait(list(waiting), num_returns=1, timeout=0.25)
                except Exception as exc:  # Ray itself is gone (shut down, or lost)
                    if self._closing.is_set() or not ray.is_initialized():
                        return
                    for hosted in waiting.values():
                        hosted.report = f"rank {hosted.rank}: Ray lost ({exc})"
                    notice(sorted(h.rank for h in waiting.values()))
                    return
                for ref in done:
                    hosted = waiting.pop(ref)
                    try:
                        hosted.died(ray.get(ref))
                    except Exception as exc:
                        hosted.report = (f"rank {hosted.rank} (pid {hosted.pid} on node "
                                         f"{hosted.node[:12]}): its host is gone "
                                         f"({type(exc).__name__}: {str(exc)[:300]})")
                    if not self._closing.is_set():
                        notice([hosted.rank])

        self._start_thread(run, "reactor-dist-ray-watch")

    # -- end ------------------------------------------------------------------------
    def close(self, grace: float) -> None:
        """Every rank ended (``grace`` seconds to exit first), every host killed, the
        placement group removed, the lifeline and its connections closed, every thread
        of the group ended; safe in any state.  Where Ray has already shut down
        (its atexit hook ran first), Ray has ended the hosts as their owner left, and
        each rank ends with its host."""
        self._closing.set()
        try:
            if self.ray.is_initialized():
                self._end_hosts(grace)
        except Exception as exc:  # never let cleanup stop the rest of the cleanup
            log.warning("ending the Ray-placed ranks: %s: %s", type(exc).__name__, exc)
        self.ranks, self.group = [], None
        if self.lifeline is not None:
            with contextlib.suppress(OSError):  # wakes the accept() a close() would not
                self.lifeline.shutdown(socket.SHUT_RDWR)
            self.lifeline.close()
        for thread in self._threads:  # the watch leaves within its 0.25 s wait
            if thread is not threading.current_thread():
                thread.join(timeout=5.0)
        for sock in self._held:
            with contextlib.suppress(OSError):
                sock.close()
        self._held, self.lifeline, self._threads = [], None, []

    def _end_hosts(self, grace: float) -> None:
        ray = self.ray
        if self.ranks:
            stops = [r.host.stop.remote(grace) for r in self.ranks]
            with contextlib.suppress(Exception):
                ray.wait(stops, num_returns=len(stops), timeout=grace + 10)
            for r in self.ranks:
                with contextlib.suppress(Exception):
                    ray.kill(r.host, no_restart=True)
        if self.group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.group)


def _fits(resources: dict[str, float], bundle: dict[str, float]) -> int:
    """How many ``bundle``s the ``resources`` hold."""
    counts = [int(resources.get(k, 0.0) // v) for k, v in bundle.items() if v > 0]
    return min(counts) if counts else 1 << 30


def _fmt(resources: dict[str, float]) -> str:
    shown = {k: (int(v) if float(v).is_integer() else round(v, 2))
             for k, v in sorted(resources.items())
             if not k.startswith("node:") and "_group_" not in k
             and k not in ("memory", "object_store_memory")}
    return "{" + ", ".join(f"{k}: {v}" for k, v in shown.items()) + "}"

