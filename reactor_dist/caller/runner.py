"""``DistributedRunner``: the public API, its state machine and the error contract.

States::

    new --start()--> healthy --crash / timeout / desync--> unusable
     |                ^    |                                  |
     |                +----|---- restarting <--- restart() ---+ (or max_restarts)
     +---------------------+------------- shutdown() ---------> closed

Only ``healthy`` accepts calls.  An unusable or closed runner refuses every call
at once with a RuntimeError that says "unusable" and chains the failure that
made it so; ``restart()`` brings an unusable runner back
(:mod:`reactor_dist.caller.restart`); a step is never replayed.  The state, the order of
calls and their waits belong to one :class:`~reactor_dist.caller.call_queue.CallQueue`;
every method here is a thin layer over it, and the ranks' processes belong to
:class:`~reactor_dist.caller.supervisor.Supervisor`.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import weakref
from collections.abc import Sequence
from concurrent.futures import Future
from time import perf_counter
from types import EllipsisType
from typing import Any

from ..errors import RankInfo
from ..main_guard import check_defined_where_ranks_run
from ..placement.external import External
from ..placement.ray_group import check_ray_options, placement_for
from ..shm.segments import DEFAULT_DIR
from ..timeouts import check_grace
from ..timeouts import check_timeout as _check_timeout
from ..wire.protocol import PINNED_LIMIT, RECORDER_SIZE_ENV, Method
from ..worker import check_not_rerunning_main
from . import aio, blocking, validation
from .call_queue import CallQueue
from .calls import Arguments
from .engine import CLOSED, HEALTHY, NEW
from .observers import Observer
from .restart import Restarts
from .session import Session
from .stream import Stream
from .supervisor import Supervisor
from .timings import CallTimings, Recorder, Stats
from .validation import (
    check_counts,
    check_devices,
    check_load_kwargs,
    check_methods,
    check_world_size,
    locate,
)


def _close(supervisor: Supervisor, queue: CallQueue, restarts: Restarts) -> None:
    """Finalizer (also at interpreter exit): never leave a process or a file behind."""
    try:
        restarts.stop()  # a restart in progress gives up first
        graceful = queue.engine.state is HEALTHY
        queue.close()  # the calls in flight fail
        supervisor.close(graceful=graceful)
    except BaseException:
        # Interrupted (Ctrl-C while a rank takes its grace period): the finalizer has
        # fired and will not run again, so end the rest now, without grace.
        supervisor.close(graceful=False)
        raise


class DistributedRunner:
    """Runs ``worker_cls`` in ``world_size`` rank processes; every call reaches every rank.

    The runner starts one process per rank (one per GPU), sends every call to every
    rank, waits for all of them and returns rank 0's result; failures follow the error
    contract (docs: Errors and recovery).  Nothing starts until :meth:`start` (or
    ``with runner:``).

    :param worker_cls: a module-level class with ``load(**load_kwargs)``,
        ``generate(input)`` and ``reset()`` (:class:`DistributedWorker` is an optional
        base); optional hooks ``rejoin()``, ``snapshot()``/``restore(state)``.
    :param world_size: how many ranks (processes, one GPU each on CUDA).
    :param load_kwargs: keyword arguments of every rank's ``load()``; they must pickle.
    :param call_timeout: seconds each call may wait for an answer from every rank,
        counted from when the ranks start it (None: no limit); a late answer is a
        WorkerTimeout and the runner unusable.  Raise it, or warm up, for a slow first
        call (``torch.compile``, CUDA graphs).  ``generate(x, timeout=)`` overrides it.
    :param start_timeout: seconds for :meth:`start` (every rank's import, group and
        ``load()``) and, by default, :meth:`restart` (None: no limit).
    :param init_process_group: form the torch.distributed group before ``load()``
        (gloo on CPU, NCCL for CUDA tensors); False for a model that forms its own.
    :param device: "auto" (a GPU per rank where CUDA is present, else the CPU), "cpu"
        or "cuda".
    :param gpus: the physical GPU ids to use, one per rank (then one per spare); sets
        each rank's CUDA_VISIBLE_DEVICES (each GPU once).  Two ranks on one GPU are
        refused (NCCL allows one rank per GPU); a spare may share a rank's GPU, and
        then takes only that rank's place.
    :param env: extra environment variables of the ranks.
    :param launch_prefix: a command that wraps each rank's (``{rank}`` substituted),
        e.g. ``[sys.executable, "-m", "reactor_dist.numa", "{rank}"]``.
    :param shm_dir: where shared-memory segments live (/dev/shm).
    :param keep_free_segments: idle warm segments each shared-memory pool keeps.
    :param shutdown_grace: seconds the ranks of a healthy runner get to exit at
        :meth:`shutdown` before SIGTERM; also how long a restart waits for a survivor.
    :param rank_output: "stderr" (each rank's output lines, ``[rank N]``-prefixed, on
        this process's stderr) or "log" (INFO records of the ``reactor_dist.rank``
        logger); a rank's own logging records go to the application's loggers either way.
    :param placement: "local" (processes on this machine), "ray" (a Ray placement
        group: see :mod:`reactor_dist.placement.ray_group`), or "external" (an
        :class:`~reactor_dist.placement.external.External`: ranks that another launcher,
        torchrun or srun, starts with ``reactor-dist-rank --join``; start() waits for them).
    :param ray_bundle: with ``placement="ray"``, each rank's bundle (default
        ``{"GPU": 1}`` for CUDA, ``{"CPU": 1}`` for CPU).
    :param ray_strategy: with ``placement="ray"``: "PACK", "SPREAD", "STRICT_PACK" or
        "STRICT_SPREAD"; rank 0 on this node where it has room.
    :param max_in_flight: calls sent to the ranks and not yet answered, at most (see
        :meth:`submit`).
    :param max_restarts: restarts the runner makes by itself after a crash, timeout or
        desync (0: never; it stays unusable until :meth:`restart`).
    :param restart_window: the seconds within which at most ``max_restarts`` restarts
        happen; past that the runner stays unusable.
    :param spares: processes loaded with no rank, each of which takes a dead rank's
        place at a restart without a ``load()`` (needs ``rejoin()``; with Ray, each in
        a bundle of its own).
    :param snapshot_every: K: every rank's ``snapshot()`` after every K calls and every
        ``reset()``; each restart restores it and runs the calls since again (0: off).
    :param retry_failed: the calls a fault failed are sent again after the automatic
        restart, and their callers get results (needs ``snapshot_every`` and
        ``max_restarts``).
    :param pinned_limit: bytes of shared memory each CUDA rank keeps page-locked
        (``cudaHostRegister``) at most: rank 0's result segments, which its CUDA tensors
        are copied into at the GPU's speed, and the inputs :meth:`DistributedWorker.to_device`
        copies from (default 2 GiB; 0: none, every copy through plain memory).
    :param record_collectives: each rank records the collectives it enters in a ring in
        /dev/shm, which the runner reads when a call fails to say which collective each
        rank is in and what differs; a timeout also reports torch's flight recorder
        (docs: Errors and recovery).  False saves a rank a few µs a collective, and turns
        the flight recorder off (``TORCH_FR_BUFFER_SIZE=0``, unless ``env`` or this
        process sets it): a failure then names no collective.
    """

    def __init__(self, worker_cls: type, *, world_size: int = 1,
                 load_kwargs: dict[str, Any] | None = None, call_timeout: float | None = 30.0,
                 start_timeout: float | None = 3600.0, init_process_group: bool = True,
                 device: str = "auto", gpus: Sequence[int] | None = None,
                 env: dict[str, str] | None = None, launch_prefix: Sequence[str] = (),
                 shm_dir: str = DEFAULT_DIR, keep_free_segments: int = 2,
                 shutdown_grace: float = 5.0, rank_output: str = "stderr",
                 placement: str | External = "local", ray_bundle: dict[str, float] | None = None,
                 ray_strategy: str = "PACK", max_in_flight: int = 2, max_restarts: int = 0,
                 restart_window: float = 600.0, spares: int = 0, snapshot_every: int = 0,
                 retry_failed: bool = False, pinned_limit: int = PINNED_LIMIT,
                 record_collectives: bool = True) -> None:
        check_not_rerunning_main()  # a rank re-running a script without its __main__ guard
        self._world_size = check_world_size(world_size)
        check_methods(worker_cls)
        where = locate(worker_cls)
        check_defined_where_ranks_run(where)  # not only under the script's main guard
        kwargs = check_load_kwargs(load_kwargs)
        self.call_timeout = _check_timeout("call_timeout", call_timeout)
        self.start_timeout = _check_timeout("start_timeout", start_timeout)
        check_counts(max_in_flight=max_in_flight, max_restarts=max_restarts, spares=spares,
                     snapshot_every=snapshot_every)
        validation.check_session(snapshot_every, retry_failed, max_restarts, worker_cls)
        if isinstance(pinned_limit, bool) or not isinstance(pinned_limit, int) \
                or pinned_limit < 0:
            raise ValueError(f"pinned_limit must be an int >= 0 (bytes of shared memory a "
                             f"CUDA rank keeps page-locked; 0: none), got {pinned_limit!r}")
        if not isinstance(record_collectives, bool):
            raise ValueError(f"record_collectives must be True or False, got "
                             f"{record_collectives!r}")
        window = _check_timeout("restart_window", restart_window)
        if window is None:
            raise ValueError("restart_window must be a number of seconds, not None")
        gpus = check_devices(device, gpus, rank_output, world_size)
        validation.check_spares(spares, worker_cls, gpus, world_size)
        ray = check_ray_options(placement, ray_bundle, ray_strategy)
        self._placement = placement if isinstance(placement, str) else "external"
        validation.check_placed_options(self._placement, gpus, rank_output)
        validation.warn_if_cores_short(world_size, device, placement)
        env = {str(k): str(v) for k, v in (env or {}).items()}
        if not record_collectives and not any(name in env or name in os.environ
                                              for name in RECORDER_SIZE_ENV):
            env[RECORDER_SIZE_ENV[0]] = "0"  # torch's flight recorder off too
        self._gpus, self._device = gpus, device
        self._worker_cls = worker_cls  # call(name): its public methods
        if where.module == "__main__":
            # Ranks define __main__'s classes as __mp_main__ (like multiprocessing): alias
            # it here so their pickles (results, exceptions) resolve in this process.
            sys.modules.setdefault("__mp_main__", sys.modules["__main__"])
        self._worker_name = f"{worker_cls.__module__}.{worker_cls.__qualname__}"
        where_ranks_run = placement_for(
            ray, world_size=world_size, device=device, env=env,
            launch_prefix=[str(p) for p in launch_prefix], gpus=gpus, rank_output=rank_output,
            start_timeout=self.start_timeout, spares=spares,
            imports_torch=bool(init_process_group) and world_size > 1,
            worker=f"{where.module}:{where.qualname}")
        self._supervisor = Supervisor(
            worker=where, world_size=world_size, load_kwargs=kwargs,
            init_process_group=bool(init_process_group), device=device,
            placement=where_ranks_run, shm_dir=shm_dir, keep_free=keep_free_segments,
            start_timeout=self.start_timeout, call_timeout=self.call_timeout,
            shutdown_grace=check_grace(shutdown_grace), spares=spares,
            pinned_limit=pinned_limit, record_collectives=record_collectives)
        self._timings = Recorder(world_size)
        session = Session(snapshot_every, world_size, shm_dir, self._supervisor.shm_prefix) \
            if snapshot_every else None
        rejoin = callable(getattr(worker_cls, "rejoin", None))
        grace = check_grace(shutdown_grace)
        self._queue = CallQueue(
            self._supervisor, max_in_flight, self._timings, session=session,
            retry_failed=retry_failed,
            restarts=lambda queue: Restarts(queue, rejoin=rejoin, grace=grace,
                                            max_restarts=max_restarts, window=window,
                                            timeout=self.start_timeout))
        self._restarts = self._queue.restarts
        assert isinstance(self._restarts, Restarts)
        self._lifecycle = threading.Lock()  # start() and shutdown() take turns
        self._finalizer = weakref.finalize(self, _close, self._supervisor, self._queue,
                                           self._restarts)

    # -- properties -----------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def restarts(self) -> int:
        """How many times the ranks were brought back (restart(), or max_restarts)."""
        return self._restarts.count

    @property
    def spares_ready(self) -> int:
        """Spares loaded and waiting to take a dead rank's place (``spares=``): after a
        takeover one fewer, until its successor, started in the background, has loaded."""
        return self._supervisor.spares.ready

    @property
    def spare_takeovers(self) -> int:
        """Ranks whose place a loaded spare took at a restart, so far."""
        return self._supervisor.spares.takeovers

    @property
    def calls_in_flight(self) -> int:
        """Calls sent to the ranks and not yet answered by every rank, now."""
        return len(self._queue.engine.in_flight)

    @property
    def ranks(self) -> tuple[RankInfo, ...]:
        """One record per rank (rank, pid, host, device, alive), to tell which process
        is which rank (to profile or signal one): () before start(); once the ranks
        ended (shutdown(), a failed start() or restart()), the last known, not alive."""
        return self._supervisor.rank_infos()

    @property
    def devices(self) -> tuple[str, ...]:
        """Each rank's device ("cpu", "cuda:0", ...), once started."""
        return tuple(self._supervisor.devices)

    @property
    def load_seconds(self) -> tuple[float | None, ...]:
        """Each rank's last ``load()`` (a rank that kept its model in a restart: its
        first), in seconds; None before it ran."""
        seconds = self._supervisor.load_seconds
        return tuple(seconds.get(rank) for rank in range(self._world_size))

    @property
    def shared_memory_bytes(self) -> int:
        """Bytes of shared memory this process holds for the runner now: its input
        pool and the result segments it maps."""
        return self._supervisor.shared_memory_bytes()

    @property
    def worker_name(self) -> str:
        """The worker class, as ``module.QualName`` (metrics name a runner by it)."""
        return self._worker_name

    @property
    def placement(self) -> str:
        """Where the ranks run: "local", "ray" or "external"."""
        return self._placement

    @property
    def join_command(self) -> str:
        """With placement="external": the command that starts one rank (start() prints it
        too), once start() has bound the join socket; "" before, and for the other
        placements."""
        return getattr(self._supervisor.placement, "join_command", "")

    @property
    def closed(self) -> bool:
        """True once shutdown() ran (or start() failed): the runner is done for good."""
        return self._queue.engine.state == CLOSED

    def attach_observer(self, observer: Observer) -> None:
        """Tell ``observer`` (:class:`reactor_dist.caller.observers.Observer`) about every call
        from now on: how metrics and traces hook in."""
        self._queue.attach(observer)

    def detach_observer(self, observer: Observer) -> None:
        self._queue.detach(observer)

    @property
    def max_in_flight(self) -> int:
        """At most this many calls are sent to the ranks and not yet answered."""
        return self._queue.engine.max_in_flight

    @property
    def healthy(self) -> bool:
        """True between a successful start() and a crash, timeout, desync or shutdown.
        Only reads: a rank that died while idle is reported by the next call."""
        return self._queue.engine.state == HEALTHY and not self._supervisor.dead()

    # -- timings (reactor_dist.caller.timings) ---------------------------------------------
    @property
    def last_timings(self) -> CallTimings | None:
        """Where the seconds of the latest answered call went: ``wall``, ``compute``,
        ``collective_wait`` and ``busy`` (per rank), ``slowest_rank``, ``encode``,
        ``wait``, ``decode``; None before the first."""
        return self._timings.last

    @property
    def record_timings(self) -> bool:
        """Whether calls are timed (default: on; ``REACTOR_DIST_TIMINGS=0`` turns it off)."""
        return self._timings.enabled

    @record_timings.setter
    def record_timings(self, on: bool) -> None:
        self._timings.enabled = bool(on)

    def stats(self, reset: bool = False) -> Stats:
        """Per-rank compute, busy time and collective wait, and the overhead (count,
        p50, p90, p99) over the calls since start or the last reset (the latest 10,000
        of them); ``str()`` is a table."""
        stats = self._timings.stats(reset)
        stats.restarts = self._restarts.count
        stats.spares_ready, stats.spare_takeovers = self.spares_ready, self.spare_takeovers
        session = self._queue.session
        if session is not None:
            stats.snapshots, stats.replayed = session.snapshots, session.replayed
            stats.replay_differences = session.differences
            stats.retried = self._queue.engine.retried
        return stats

    def reset_stats(self) -> None:
        """Forget the calls that stats() summarises."""
        self._timings.reset()

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Start every rank and return once each finished load()."""
        queue = self._queue
        with self._lifecycle:
            if queue.engine.state != NEW:
                raise RuntimeError("a DistributedRunner starts once; restart() brings its "
                                   "ranks back after a failure")
            if "opentelemetry.trace" in sys.modules:  # the app uses OpenTelemetry
                from ..tracing import instrument_if_configured
                instrument_if_configured(self)  # spans when it set a tracer provider
            began = perf_counter()
            try:
                self._supervisor.start(self.start_timeout)
            except BaseException as exc:
                self._supervisor.close(graceful=False)
                queue.start_failed(exc)
                self._lifecycle_ended("start", began, exc)
                raise
            queue.open()
            if queue.session is not None:
                try:
                    queue.first_snapshot(self.call_timeout)
                except BaseException as exc:
                    queue.close()
                    self._supervisor.close(graceful=False)
                    self._lifecycle_ended("start", began, exc)
                    raise
            self._lifecycle_ended("start", began, None)
            validation.warn_if_no_cuda(self._supervisor.devices, self._gpus, self._device)

    def _lifecycle_ended(self, name: str, began: float, error: BaseException | None) -> None:
        self._queue.tell_observers("lifecycle", name, began, perf_counter(), error)

    def generate(self, input: Any, /, *, timeout: float | None | EllipsisType = ...,
                 queue_timeout: float | None | EllipsisType = ...) -> Any:
        """Run ``generate(input)`` on every rank; rank 0's result, or the contract's error.

        Two bounds, in seconds (None: no limit): ``timeout`` (default ``call_timeout``)
        bounds, from when the ranks start the call, each wait for an answer; a late one
        makes the runner unusable.  ``queue_timeout`` (default: ``timeout``) bounds the
        wait for the call's turn (``max_in_flight`` calls in flight, or a restart in
        progress): then CallQueueFull, nothing sent, the runner still healthy; ``0``
        never waits."""
        return blocking.call(self._queue, Method.GENERATE, input,
                             *self._bounds(timeout, queue_timeout))

    def submit(self, input: Any, /, *, timeout: float | None | EllipsisType = ...,
               queue_timeout: float | None | EllipsisType = ...) -> Future:
        """Send ``generate(input)`` to every rank now and return at once: the future's
        ``result()`` is what :meth:`generate` would return or raise for this call.

        The ranks run calls in the order sent; while the app works on one result the
        ranks already compute the next.  With ``max_in_flight`` calls in flight this
        waits for one to be answered, at most ``queue_timeout`` (then CallQueueFull:
        nothing was sent, the runner stays healthy; ``submit(x, queue_timeout=0)`` drops
        a frame when the model is busy); ``timeout`` bounds, from when the ranks start
        the call, each wait for its replies (see :meth:`generate`)."""
        return blocking.submit(self._queue, Method.GENERATE, input,
                               *self._bounds(timeout, queue_timeout))

    def stream(self, input: Any, /, *, timeout: float | None | EllipsisType = ...,
               queue_timeout: float | None | EllipsisType = ...) -> Stream:
        """Run ``generate(input)`` on every rank; iterate rank 0's items as they are made.

        ``timeout`` bounds the wait for each next item and for the end of the step,
        ``queue_timeout`` the wait for its turn (see :meth:`generate`).  Leaving early
        lets the step finish on every rank and drops the rest unread."""
        return Stream.send(self._queue, input, *self._bounds(timeout, queue_timeout))

    def reset(self, *, timeout: float | None | EllipsisType = ...,
              queue_timeout: float | None | EllipsisType = ...) -> None:
        """Run ``reset()`` on every rank (clear session state, keep weights); the bounds
        as in :meth:`generate`."""
        blocking.call(self._queue, Method.RESET, None, *self._bounds(timeout, queue_timeout))

    def call(self, name: str, /, *args: Any, **kwargs: Any) -> Any:
        """Run the worker's public method ``name(*args, **kwargs)`` on every rank, in order
        with the calls in flight, under the whole contract of :meth:`generate` (bounded by
        ``call_timeout``); rank 0's result.  For what every rank must take between steps:
        a LoRA, a style, a seed, a profiler switch.  A name the worker class lacks, or a
        private one, is an error before anything is sent.  With ``snapshot_every`` the
        call is journaled and replayed like a ``generate``."""
        return blocking.call(self._queue, *self._named(name, args, kwargs, "call"),
                             self.call_timeout, self.call_timeout)

    def call_all(self, name: str, /, *args: Any, **kwargs: Any) -> list[Any]:
        """:meth:`call`, returning every rank's result, in rank order."""
        return blocking.call(self._queue, *self._named(name, args, kwargs, "call_all"),
                             self.call_timeout, self.call_timeout)

    def _named(self, name: str, args: tuple, kwargs: dict[str, Any],
               form: str) -> tuple[str, Any]:
        """The method and the value of a call by name (checked: nothing is sent else)."""
        validation.check_method_name(self._worker_cls, name, form, args, kwargs)
        if name == Method.GENERATE:
            return name, args[0]
        if name == Method.RESET:
            return name, None
        return name, Arguments(args, kwargs, form.endswith("_all"))

    def wait_idle(self, timeout: float | None | EllipsisType = ...) -> bool:
        """Wait until the ranks answered every call sent so far, also the calls nobody
        waits for any more (Ctrl-C, a cancelled task, a stream left early, a submitted
        call): True once idle, False when ``timeout`` (default ``call_timeout``, None: no
        limit) ran out first; the runner stays usable either way."""
        return blocking.wait_idle(self._queue, self._timeout(timeout))

    def restart(self, *, timeout: float | None | EllipsisType = ...) -> None:
        """Bring the runner back to what start() leaves (every rank loaded, same
        world_size, GPUs and options, healthy), from an unusable or a healthy runner.

        A worker class that defines ``rejoin(self)`` keeps the ranks that are alive and
        answer within ``shutdown_grace``: they leave the old torch.distributed group,
        join a new one with the replacement ranks and run ``rejoin()``; only the others
        get a new process and ``load()`` (with ``spares=``: a loaded spare's process,
        while there is one, with ``rejoin()`` and no ``load()``).  Without it every rank
        is started again.  Calls
        in flight fail; ``timeout`` (default ``start_timeout``) bounds it all.  Raises
        what start() would (the runner stays unusable)."""
        timeout = self.start_timeout if timeout is ... else _check_timeout("timeout", timeout)
        with self._lifecycle:
            self._queue.begin_restart()
            began = perf_counter()
            try:
                self._restarts.run(timeout)
            except BaseException as exc:
                self._lifecycle_ended("restart", began, exc)
                raise
            self._lifecycle_ended("restart", began, None)

    async def arestart(self, *, timeout: float | None | EllipsisType = ...) -> None:
        """:meth:`restart`, in a thread of its own: the event loop keeps running meanwhile."""
        await asyncio.to_thread(self.restart, timeout=timeout)

    def _timeout(self, timeout: float | None | EllipsisType) -> float | None:
        return self.call_timeout if timeout is ... else _check_timeout("timeout", timeout)

    def _bounds(self, timeout: float | None | EllipsisType,
                queue_timeout: float | None | EllipsisType) -> tuple[float | None, float | None]:
        """A call's run bound and its bound for the wait for its turn (default: the same)."""
        if timeout is ... and queue_timeout is ...:  # the common call: both defaults
            return self.call_timeout, self.call_timeout
        run = self._timeout(timeout)
        return run, run if queue_timeout is ... else _check_timeout(
            "queue_timeout", queue_timeout, zero=True)

    # -- asyncio ---------------------------------------------------------------------------
    async def astart(self) -> None:
        """:meth:`start`, in a thread of its own: the event loop keeps running meanwhile."""
        await asyncio.to_thread(self.start)

    async def agenerate(self, input: Any, /, *, timeout: float | None | EllipsisType = ...,
                        queue_timeout: float | None | EllipsisType = ...) -> Any:
        """:meth:`generate` for a task: the loop never blocks; calls of several tasks
        are sent in the order they asked, up to ``max_in_flight`` at once."""
        return await aio.call(self._queue, Method.GENERATE, input,
                              *self._bounds(timeout, queue_timeout))

    @aio.must_await
    async def areset(self, *, timeout: float | None | EllipsisType = ...,
                     queue_timeout: float | None | EllipsisType = ...) -> None:
        """:meth:`reset` for a task."""
        await aio.call(self._queue, Method.RESET, None, *self._bounds(timeout, queue_timeout))

    def astream(self, input: Any, /, *, timeout: float | None | EllipsisType = ...,
                queue_timeout: float | None | EllipsisType = ...) -> aio.AsyncStream:
        """:meth:`stream` for ``async for``; the call is sent at the first item awaited."""
        return aio.AsyncStream(self._queue, input, *self._bounds(timeout, queue_timeout))

    async def acall(self, name: str, /, *args: Any, **kwargs: Any) -> Any:
        """:meth:`call` for a task."""
        return await aio.call(self._queue, *self._named(name, args, kwargs, "acall"),
                              self.call_timeout, self.call_timeout)

    async def acall_all(self, name: str, /, *args: Any, **kwargs: Any) -> list[Any]:
        """:meth:`call_all` for a task."""
        return await aio.call(self._queue, *self._named(name, args, kwargs, "acall_all"),
                              self.call_timeout, self.call_timeout)

    async def await_idle(self, timeout: float | None | EllipsisType = ...) -> bool:
        """:meth:`wait_idle` for a task."""
        return await aio.wait_idle(self._queue, self._timeout(timeout))

    @aio.must_await
    async def ashutdown(self) -> None:
        """:meth:`shutdown`, in a thread of its own (it may wait for the ranks' grace)."""
        await asyncio.to_thread(self.shutdown)

    async def __aenter__(self) -> DistributedRunner:
        if self._queue.engine.state == NEW:
            await self.astart()
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.ashutdown()

    def shutdown(self) -> None:
        """End every rank and remove every file. Idempotent; also runs at exit."""
        with self._lifecycle:
            self._finalizer()

    def __enter__(self) -> DistributedRunner:
        if self._queue.engine.state == NEW:
            self.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return (f"<DistributedRunner {self._worker_name} world_size={self._world_size} "
                f"state={self._queue.engine.state}>")
