"""Ranks placed by Ray across nodes (``DistributedRunner(..., placement="ray")``).

Ray reserves and places; the rest is the local runner's::

    reserve()   a placement group of world_size + spares bundles (rank i in bundle i, the
                spares in the bundles after); bundle 0 pinned to the caller's node
                (label ray.io/node-id) where it has room
    hosts       one RankHost actor per bundle (reactor_dist.placement.ray_host): where() -> node id,
                pid, the rank's CurveZMQ public key; a node's address is the one Ray
                reports for it (ray.nodes()), never a guess at the machine's
    bus         ranks on the caller's node: ipc:// and /dev/shm, as locally; ranks on
                other nodes: the runner's sockets on TCP at its node's address, CurveZMQ
                with only the hosts' keys admitted, payloads in-band, the group's store
                a TCPStore on rank 0's node
    launch()    each host starts its rank (same rank code, same bootstrap); a spare's
                host its spare (start_spare), which reaches the spares' socket over
                TCP too where it runs on another node
    takeover    a spare's handle becomes the dead rank's (its host: become()); the dead
                rank's bundle holds the next spare
    watch       a thread waits on every host's exited(): a rank's death (or its host's,
                or its node's) is a death notice like a local one
    lifeline    each host holds a TCP connection to the runner: broken, it ends its rank

Locality is decided by Ray's node id alone, never by trying shared memory.
:class:`RayGroup` is the runner's placement (base.Placement) and each
:class:`HostedRank` its handle on one rank (base.Rank): the supervisor asks them
what it asks of a local placement and its ranks.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from .. import timeouts
from ..caller.spares import spare_label
from ..errors import PlacementFailed, WorkerTimeout
from ..wire import framing
from ..wire.protocol import MAX_FRAME_ENV, MAX_MESSAGE_ENV, Bootstrap, torchrun_env
from .base import DeathWatch, Placement, Rank, Ranks
from .external import External, ExternalGroup, check_external
from .local import LocalPlacement
from .ray_host import RankHost
from .ray_view import THREADS_ENV, check_own_gpus, connect, local_place

if TYPE_CHECKING:
    from ..caller.bus import Bus

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
RAY_EXTRA = "pip install 'reactor-dist[ray]'"
NODE_LABEL = "ray.io/node-id"
PIN_WAIT = 2.0  # seconds a group with rank 0 pinned to the caller's node may take
STOPPED_EVERY = 0.5  # seconds between two questions to a host whether its rank is stopped
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


def check_ray_options(placement: str | External, bundle: Any,
                      strategy: Any) -> RaySpec | External | None:
    """The placement's options: None for "local", a RaySpec for "ray", an External for
    "external" (or the External given)."""
    if isinstance(placement, External):
        return placement
    if placement not in ("local", "ray", "external"):
        raise ValueError(f"placement must be 'local', 'ray', 'external' or an "
                         f"External(...), got {placement!r}")
    if placement == "external":
        return External()
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


def placement_for(spec: RaySpec | External | None, *, world_size: int, device: str,
                  env: dict[str, str], launch_prefix: list[str], gpus: list[int] | None,
                  rank_output: str, start_timeout: float | None, spares: int = 0,
                  imports_torch: bool = False, worker: str = "") -> Placement:
    """The runner's placement: ``spec`` (check_ray_options) None is placement="local";
    ``imports_torch``: its ranks form a torch group; ``worker``: its class, as a joined
    rank's --worker names it (module:Class)."""
    if isinstance(spec, External):
        check_external(spares, launch_prefix, worker)
        return ExternalGroup(world_size, spec, worker, start_timeout)
    if spec is None:
        return LocalPlacement(world_size, env=env, gpus=gpus, launch_prefix=launch_prefix,
                              output=rank_output, torch=imports_torch)
    return RayGroup(world_size, spec, device, env=env, launch_prefix=launch_prefix,
                    start_timeout=start_timeout, spares=spares)


class HostedRank(Rank):
    """The runner's handle on a rank that a RankHost runs on its node: answered through
    Ray; its death is reported by its group's watch (RayGroup.watch)."""

    def __init__(self, rank: int, host: Any, node: str, address: str, host_pid: int,
                 local: bool, hostname: str = "") -> None:
        self.rank, self.host, self.node, self.address = rank, host, node, address
        self.host_pid, self.local, self.hostname = host_pid, local, hostname
        self.pid = 0  # on its node, once launched
        self.report: str | None = None  # its crash report, once dead
        self.returncode: int | None = None  # once dead, as its host saw it (None: unknown)
        self.lines: list[str] = []  # its last lines, once dead (its host keeps them)
        self._exit: tuple[int, Any] | None = None  # (pid, its host's exited() on its way)
        self._stopped, self._stopped_ref, self._stopped_asked = False, None, 0.0

    def in_same_bundle(self, rank: int) -> HostedRank:
        """A new handle on what its host runs next (a spare, slot ``rank``)."""
        return HostedRank(rank, self.host, self.node, self.address, self.host_pid,
                          self.local, self.hostname)

    def exit_ref(self) -> Any:
        """Its host's ``exited()`` for this process, asked once: each such call holds
        one of the host's threads until the process dies, and every watch shares it."""
        if self._exit is None or self._exit[0] != self.pid:
            self._exit = (self.pid, self.host.exited.remote())
        return self._exit[1]

    def become(self, rank: int) -> None:
        """A spare's handle is rank ``rank``'s now; its host names it so too."""
        self.rank = rank
        with contextlib.suppress(Exception):  # its host gone: its death tells the rest
            self.host.become.remote(rank)

    @property
    def launcher_pid(self) -> int:
        """Where its code runs (its host started it: the same pid)."""
        return self.pid

    def launched(self, pid: int) -> None:
        """Its host started it (again): a new process, not dead."""
        self.pid, self.report, self.returncode, self.lines = pid, None, None, []
        self._stopped, self._stopped_ref = False, None

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
        """What its host said the last time it was asked (at most STOPPED_EVERY seconds
        ago; never waited for: the spares' thread asks under its lock), False until it
        has answered once."""
        import ray

        now = time.monotonic()
        if self._stopped_ref is not None:
            with contextlib.suppress(Exception):  # its host gone: its death tells
                done, _ = ray.wait([self._stopped_ref], timeout=0)
                if not done:
                    return self._stopped
                self._stopped = bool(ray.get(self._stopped_ref))
            self._stopped_ref = None
        if now - self._stopped_asked >= STOPPED_EVERY and self.alive():
            self._stopped_asked = now
            with contextlib.suppress(Exception):
                self._stopped_ref = self.host.stopped.remote()
        return self._stopped and self.alive()

    def signal(self, sig: int, group: bool = True) -> None:
        """Through its host, which signals the rank (its process group, or with ``group``
        false its own process) on its node."""
        import ray

        with contextlib.suppress(Exception):  # its host gone: its rank went with it
            ray.get(self.host.signal.remote(sig, group), timeout=10)

    def report_lines(self) -> list[str]:
        return list(self.lines)

    def crash_report(self) -> str:
        return self.report or f"rank {self.rank} (pid {self.pid}) still running"

    def stacks_later(self) -> RemoteStacks:
        """Its host's stacks() (SIGUSR1 and the dump, on its node)."""
        return RemoteStacks(self, self.host.stacks.remote())

    def watch_with(self, deaths: DeathWatch) -> None:
        deaths.watched_elsewhere(self)  # RayGroup.watch calls deaths.notice

    def runs_in(self, pid: int, deaths: DeathWatch) -> None:
        """Nothing to watch from here: ``pid`` is a process on the rank's node, and its
        host watches the process it started."""

    @classmethod
    def end_all(cls, ranks: Sequence[Rank], grace: float, term_grace: float) -> None:
        """Each host ends its rank (RankHost.end_rank), side by side; the hosts stay.
        Where Ray has already shut down, the hosts, and their ranks, are gone already."""
        import ray

        hosted = cast("list[HostedRank]", list(ranks))
        if not hosted or not ray.is_initialized():
            return
        with contextlib.suppress(Exception):
            ray.wait([r.host.end_rank.remote(grace, term_grace) for r in hosted],
                     num_returns=len(hosted),
                     timeout=timeouts.for_library(grace) + term_grace + 30)


class RemoteStacks:
    """A hosted rank's stacks on their way (its host's ``stacks()``)."""

    def __init__(self, handle: HostedRank, later: Any) -> None:
        self.handle, self.later = handle, later

    def text(self) -> str:
        import ray

        hosted = self.handle
        try:
            return ray.get(self.later, timeout=10)
        except Exception as exc:
            return f"rank {hosted.rank} (pid {hosted.pid} on node {hosted.node[:12]}): " \
                   f"no stacks ({type(exc).__name__}: {exc})"


class RayGroup(Placement):
    """placement="ray": the placement group, the hosts and their watch, of one runner."""

    def __init__(self, world_size: int, spec: RaySpec, device: str, *, env: dict[str, str],
                 launch_prefix: list[str], start_timeout: float | None,
                 spares: int = 0) -> None:
        self.ray = import_ray()
        self.world_size, self.spec, self.device = world_size, spec, device
        self.env, self.launch_prefix, self.start_timeout = env, launch_prefix, start_timeout
        self.bundles = world_size + spares  # the spares' after the ranks'
        self.group: Any = None
        self.hosts: list[HostedRank] = []  # each bundle's first handle (its place)
        self.ranks: list[HostedRank] = []  # each rank's handle now
        self.launched: set[int] = set()  # the places whose host launched a process
        self.master_port = 0
        self.bundle: dict[str, float] = {}
        self.lifeline: socket.socket | None = None
        self._remote: dict[str, Any] = {}  # a rank on another node: the bus's TCP side
        self._held: list[socket.socket] = []
        self._closing = threading.Event()
        self._threads: list[threading.Thread] = []  # the lifeline's and the watch's

    # -- the placement's interface ----------------------------------------------------
    @property
    def shares_memory(self) -> bool:
        """Every rank is on the runner's node (locality by Ray's node id alone)."""
        return not self.spans_nodes

    def bootstrap_fields(self, rank: int) -> dict[str, Any]:
        """On another node than the runner, the bus over TCP (CurveZMQ), the group's
        store at rank 0's node; its own GPUs alone (ray_view)."""
        return self._fields_for(self.ranks[rank])

    def spare_fields(self, place: int) -> dict[str, Any]:
        """A spare's, in bundle ``place``: a rank's, and on another node than the runner
        the spares' socket over TCP."""
        return self._fields_for(self.hosts[place])

    def _fields_for(self, hosted: HostedRank) -> dict[str, Any]:
        remote = self._remote
        return dict(master_addr=self.store_address(),
                    device_index=0 if self.own_gpus else None,
                    log_levels=None,  # Ray forwards the ranks' output as plain lines
                    **({} if hosted.local else {**remote, "runner_pid": hosted.host_pid}))

    def store_address(self) -> str:
        return self.ranks[0].address if self._remote else ""

    def start(self, ranks: Ranks, bootstrap: Callable[[int], Bootstrap], bus: Bus,
              deadline: float) -> None:
        """Reserve, then start each rank through its host; a rank on another node than
        this one reaches the bus over TCP (CurveZMQ)."""
        self.reserve(timeouts.for_library(max(deadline - time.monotonic(), 0.01)),
                     timeouts.for_library(self.start_timeout))
        if self.spans_nodes:
            cmd, reply, spares, server = bus.open_tcp(self.address, self.remote_keys())
            self._remote = {"cmd_addr": cmd, "reply_addr": reply, "spare_addr": spares,
                            "curve": (server, b"", b""), "shared_memory": False}
        boots = []
        for hosted in self.ranks:
            ranks.add(hosted)
            boots.append(bootstrap(hosted.rank))
        self.watch(ranks.watch)
        bounds = {MAX_FRAME_ENV: str(framing.MAX_FRAME), MAX_MESSAGE_ENV: str(framing.MAX_MESSAGE)}
        self.launch(boots, {**bounds, **self.env}, self.launch_prefix,
                    timeouts.for_library(max(deadline - time.monotonic(), 0.01)))

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
                f"Ray could not reserve {self._bundles_named()} of {_fmt(self.bundle)} "
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
        strategy, n = self.spec.strategy, self.bundles
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
            f"the Ray cluster cannot hold {self._bundles_named()} of {_fmt(self.bundle)} "
            f"({strategy}): {why}; its {len(nodes)} node(s) have "
            f"{[_fmt(x['Resources']) for x in nodes]}. Add nodes, lower world_size"
            f"{' or spares' if self.bundles > self.world_size else ''} or change "
            f"ray_bundle / ray_strategy")

    def _bundles_named(self) -> str:
        """"4 bundles", or "3 bundles (2 ranks, 1 spare)" where there are spares."""
        spares = self.bundles - self.world_size
        if not spares:
            return f"{self.bundles} bundles"
        return (f"{self.bundles} bundles ({self.world_size} rank{'s' * (self.world_size > 1)}"
                f", {spares} spare{'s' * (spares > 1)})")

    def _try_group(self, pinned: bool, wait: float) -> bool:
        from ray.util.placement_group import placement_group, remove_placement_group

        bundles = [dict(self.bundle) for _ in range(self.bundles)]
        selector = [{NODE_LABEL: self.node}] + [{}] * (self.bundles - 1) if pinned else None
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
            self.group, placement_group_bundle_index=place)).remote(place, self.world_size)
                 for place in range(self.bundles)]
        # Known before anything can fail, so that close() ends whatever started.
        self.hosts = [HostedRank(p, h, table.get(p, "?"), "", 0, False)
                      for p, h in enumerate(hosts)]
        self.ranks = self.hosts[:self.world_size]
        wheres = self._get([h.where.remote() for h in hosts], timeout, "start the ranks' hosts")
        self.hosts = [HostedRank(p, h, node, self.addresses[node], pid, node == self.node,
                                 self.hostnames.get(node, ""))
                      for p, (h, (node, pid, *_)) in enumerate(zip(hosts, wheres, strict=True))]
        self.ranks = self.hosts[:self.world_size]
        self.keys = {p: where[2] for p, where in enumerate(wheres)}
        if self.own_gpus:  # cuda:0 must be each rank's own GPU
            check_own_gpus([(p, node, gpus, visible)
                            for p, (node, _, _, gpus, visible) in enumerate(wheres)])

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
        """A rank or a spare (which may become one) runs on another node."""
        return not all(h.local for h in self.hosts)

    def remote_keys(self) -> set[bytes]:
        return {self.keys[place] for place, h in enumerate(self.hosts) if not h.local}

    def launch(self, boots: list[Bootstrap], env: dict[str, str], launch_prefix: list[str],
               timeout: float) -> None:
        """Start every rank through its host (the bootstraps are ready)."""
        master = self.ranks[0]
        # MASTER_PORT for models that form their own group (init_process_group=False).
        deadline = time.monotonic() + timeout
        self.master_port = self._get(master.host.free_port.remote(master.address), timeout,
                                     "reach rank 0's host")
        self.lifeline_address = self._open_lifeline()
        self.launch_env = (env, launch_prefix)
        calls = [hosted.host.launch.remote(  # {rank}: filled in by RankProcess.spawn
            boot.to_bytes(), env, launch_prefix, self._torch_env(hosted.rank),
            self.lifeline_address, os.environ.get(THREADS_ENV))
            for hosted, boot in zip(self.ranks, boots, strict=True)]
        self.launched.update(range(self.world_size))
        pids = self._get(calls, deadline - time.monotonic(), "start the ranks")
        for hosted, pid in zip(self.ranks, pids, strict=True):
            hosted.pid = pid

    def _torch_env(self, rank: int, place: int | None = None) -> dict[str, str]:
        """The torchrun environment of rank ``rank``, or of a spare in bundle ``place``
        (no RANK: its process sets it as it takes one)."""
        if place is None:
            local = local_place(rank, [r.node for r in self.ranks], self.own_gpus)
        else:
            local = local_place(place, [h.node for h in self.hosts], self.own_gpus)
        env = torchrun_env(rank, self.world_size, self.master_port, self.ranks[0].address,
                           local)
        if place is not None:
            env.pop("RANK")
        return env

    def start_spare(self, slot: int, place: int, bootstrap: Bootstrap, label: str) -> Rank:
        """The host of bundle ``place`` starts a spare (its first process, or the next
        after a rank that a spare replaced, or a spare that died); a thread watches it
        while it is a spare."""
        spare = self.hosts[place].in_same_bundle(slot)
        boot, torch_env = bootstrap.to_bytes(), self._torch_env(slot, place)
        if place in self.launched:
            call = spare.host.relaunch.remote(boot, torch_env, label)
        else:
            env, launch_prefix = self.launch_env
            call = spare.host.launch.remote(boot, env, launch_prefix, torch_env,
                                            self.lifeline_address,
                                            os.environ.get(THREADS_ENV), label)
        self.launched.add(place)
        spare.pid = self._get(call, timeouts.for_library(self.start_timeout),
                              f"start {label}")
        self._watch_spare(spare)
        return spare

    def _watch_spare(self, spare: HostedRank) -> None:
        """Its death as a spare is known to its handle (spares.py looks); once it is a
        rank, the ranks' watch reports it."""
        ray, ref = self.ray, spare.exit_ref()

        def run() -> None:
            while not self._closing.is_set() and spare.rank >= self.world_size:
                try:
                    done, _ = ray.wait([ref], timeout=0.25)
                except Exception:  # Ray itself is gone
                    return
                if done and spare.rank >= self.world_size:
                    try:
                        spare.died(ray.get(ref))
                    except Exception as exc:
                        spare.report = f"{spare_label(spare.rank)}: its host is gone ({exc})"
                    return

        self._start_thread(run, "reactor-dist-ray-spare")

    def _open_lifeline(self) -> tuple[str, int]:
        """A TCP listener every host holds a connection to: when this process dies the
        kernel closes it, and the hosts end their ranks and themselves at once, however
        long Ray takes to notice (ray_host.RankHost._hold)."""
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

    def restart(self, replaced: list[int], old: Ranks, ranks: Ranks,
                bootstrap: Callable[[int], Bootstrap]) -> None:
        """``replaced`` start again through their hosts, in their bundles; every other
        rank keeps its handle from ``old`` (a spare's, where one took its place), and the
        watch reports to ``ranks`` from now on."""
        self.ranks = [cast(HostedRank, old.procs[r]) for r in range(self.world_size)]
        for hosted in self.ranks:
            ranks.add(hosted)
        calls = [self.ranks[r].host.relaunch.remote(bootstrap(r).to_bytes(), self._torch_env(r))
                 for r in replaced]
        try:
            pids = self._get(calls, timeouts.for_library(self.start_timeout),
                             "start the replaced ranks again")
        except self.ray.exceptions.RayError as exc:  # a host that is gone (its node?)
            raise PlacementFailed(f"the bundle of rank {', '.join(map(str, replaced))} could "
                                  f"not be placed again: {type(exc).__name__}: {exc}"
                                  ) from exc
        for rank, pid in zip(replaced, pids, strict=True):
            self.ranks[rank].launched(pid)
        self.watch(ranks.watch)

    def watch(self, deaths: DeathWatch) -> None:
        """A thread that reports each rank's death (or its host's) to ``deaths``, the
        watch of the ranks' generation, until it closes (a restart begins, or the ranks
        end): the handles it updates pass to the next generation."""
        ray = self.ray
        waiting = {r.exit_ref(): r for r in self.ranks}

        def run() -> None:
            while waiting and not self._closing.is_set() and not deaths.closed:
                try:
                    done, _ = ray.wait(list(waiting), num_returns=1, timeout=0.25)
                except Exception as exc:  # Ray itself is gone (shut down, or lost)
                    if self._closing.is_set() or deaths.closed or not ray.is_initialized():
                        return
                    for hosted in waiting.values():
                        hosted.report = f"rank {hosted.rank}: Ray lost ({exc})"
                    deaths.notice(sorted(h.rank for h in waiting.values()))
                    return
                for ref in done:
                    if deaths.closed:
                        return  # a death of a generation that is over
                    hosted = waiting.pop(ref)
                    try:
                        hosted.died(ray.get(ref))
                    except Exception as exc:
                        hosted.report = (f"rank {hosted.rank} (pid {hosted.pid} on node "
                                         f"{hosted.node[:12]}): its host is gone "
                                         f"({type(exc).__name__}: {str(exc)[:300]})")
                    if not self._closing.is_set():
                        deaths.notice([hosted.rank])

        self._start_thread(run, "reactor-dist-ray-watch")

    # -- end ------------------------------------------------------------------------
    def close(self, ranks: Ranks, grace: float) -> None:
        """Every rank ended (``grace`` seconds to exit first), every host killed, the
        placement group removed, the lifeline and its connections closed, every thread
        of the group ended; safe in any state.  Where Ray has already shut down
        (its atexit hook ran first), Ray has ended the hosts as their owner left, and
        each rank ends with its host."""
        self._closing.set()
        grace = timeouts.for_library(grace)
        try:
            ranks.end(grace)  # each host ends its rank (HostedRank.end_all)
            if self.ray.is_initialized():
                self._end_hosts(grace)
        except Exception as exc:  # never let cleanup stop the rest of the cleanup
            log.warning("ending the Ray-placed ranks: %s: %s", type(exc).__name__, exc)
        self.ranks, self.hosts, self.group = [], [], None
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
        """Each host stops (its rank ended already, or had not started: ``grace`` covers
        the second) and closes its lifeline; then the actors and the bundles go."""
        ray = self.ray
        if self.hosts:
            stops = [h.host.stop.remote(grace) for h in self.hosts]
            with contextlib.suppress(Exception):
                ray.wait(stops, num_returns=len(stops), timeout=grace + 10)
            for h in self.hosts:
                with contextlib.suppress(Exception):
                    ray.kill(h.host, no_restart=True)
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

