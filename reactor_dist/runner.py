"""``DistributedRunner``: the public API, its state machine and the error contract.

States::

    new --start()--> ready --crash / timeout / desync--> unusable
     |                 |                                    |
     +-----------------+------------- shutdown() ---------> closed

Only ``ready`` accepts calls.  An unusable or closed runner refuses every call
at once with a RuntimeError that says "unusable" and chains the failure that
made it so; it never restarts a rank nor replays a step.  One call is one
:meth:`Transport.call <reactor_dist.transport.Transport.call>` (processes, bus,
shared memory) and one :func:`~reactor_dist.outcome.judge` (the error contract).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from time import perf_counter
from types import EllipsisType
from typing import Any

from . import aio
from .calls import PendingCall
from .errors import WorkerCrashed, WorkerTimeout
from .outcome import judge
from .output import OUTPUT_MODES
from .placement import check_ray_options
from .protocol import Method
from .shm import DEFAULT_DIR
from .stream import Stream
from .timeouts import check_grace, slice_of
from .timeouts import check_timeout as _check_timeout
from .timings import CallTimings, Recorder, Stats
from .transport import Transport
from .validation import (
    check_load_kwargs,
    check_methods,
    check_not_rerunning_main,
    check_world_size,
    locate,
)

NEW, READY, UNUSABLE, CLOSED = "new", "ready", "unusable", "closed"
log = logging.getLogger("reactor_dist")
_warned_auto_cpu = False


def _close(transport: Transport, state: list[str]) -> None:
    """Finalizer (also at interpreter exit): never leave a process or a file behind."""
    graceful = state[0] == READY
    state[0] = CLOSED
    try:
        transport.close(graceful=graceful)
    except BaseException:
        # Interrupted (Ctrl-C while a rank takes its grace period): the finalizer has
        # fired and will not run again, so end the rest now, without grace.
        transport.close(graceful=False)
        raise


class DistributedRunner:
    """Runs ``worker_cls`` in ``world_size`` rank processes; every call reaches every rank.

    Options past the Reactor API: ``device`` ("auto", "cpu" or "cuda"), ``gpus``
    (physical GPU ids, one per rank; sets CUDA_VISIBLE_DEVICES), ``env`` (extra
    environment of the ranks), ``launch_prefix`` (wraps each rank's command,
    ``{rank}`` substituted), ``shm_dir``, ``keep_free_segments`` (idle warm
    segments each pool keeps), ``shutdown_grace`` (seconds a healthy group
    gets to exit before SIGTERM) and ``rank_output`` ("stderr": each rank's lines,
    ``[rank N]``-prefixed, on this process's stderr; "log": as INFO records of the
    ``reactor_dist.rank`` logger).

    ``placement="ray"`` places the ranks on a Ray cluster (``ray.init(address="auto")``
    unless Ray is initialised here): one placement group of ``world_size`` bundles of
    ``ray_bundle`` (default ``{"GPU": 1}`` for CUDA, ``{"CPU": 1}`` for CPU) under
    ``ray_strategy`` ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"); rank 0 on this
    node where it has room.  See :mod:`reactor_dist.placement`.
    """

    def __init__(self, worker_cls: type, *, world_size: int = 1,
                 load_kwargs: dict[str, Any] | None = None, call_timeout: float | None = 30.0,
                 start_timeout: float | None = 3600.0, init_process_group: bool = True,
                 device: str = "auto", gpus: Sequence[int] | None = None,
                 env: dict[str, str] | None = None, launch_prefix: Sequence[str] = (),
                 shm_dir: str = DEFAULT_DIR, keep_free_segments: int = 2,
                 shutdown_grace: float = 5.0, rank_output: str = "stderr",
                 placement: str = "local", ray_bundle: dict[str, float] | None = None,
                 ray_strategy: str = "PACK") -> None:
        check_not_rerunning_main()  # a rank re-running a script without its __main__ guard
        self._world_size = check_world_size(world_size)
        check_methods(worker_cls)
        where = locate(worker_cls)
        kwargs = check_load_kwargs(load_kwargs)
        self.call_timeout = _check_timeout("call_timeout", call_timeout)
        self.start_timeout = _check_timeout("start_timeout", start_timeout)
        if rank_output not in OUTPUT_MODES:
            raise ValueError(f"rank_output must be 'stderr' or 'log', got {rank_output!r}")
        if device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
        if gpus is not None:
            gpus = [int(g) for g in gpus]
            if len(gpus) < world_size:
                raise ValueError(f"gpus={gpus} names {len(gpus)} GPUs for {world_size} ranks; "
                                 f"give one GPU per rank")
        ray = check_ray_options(placement, ray_bundle, ray_strategy)
        if ray is not None and (gpus is not None or rank_output == "log"):
            raise ValueError("gpus= and placement='ray' exclude each other: Ray assigns the "
                             "GPUs (ray_bundle); leave gpus out" if gpus is not None else
                             "rank_output='log' does not apply with placement='ray': Ray "
                             "forwards the ranks' output lines (log_to_driver)")
        env = {str(k): str(v) for k, v in (env or {}).items()}
        self._gpus, self._device = gpus, device
        if where.module == "__main__":
            # Ranks define __main__'s classes as __mp_main__ (like multiprocessing): alias
            # it here so their pickles (results, exceptions) resolve in this process.
            sys.modules.setdefault("__mp_main__", sys.modules["__main__"])
        self._worker_name = f"{worker_cls.__module__}.{worker_cls.__qualname__}"
        self._transport = Transport(
            worker=where, world_size=world_size, load_kwargs=kwargs,
            init_process_group=bool(init_process_group), device=device, gpus=gpus, env=env,
            launch_prefix=[str(p) for p in launch_prefix], shm_dir=shm_dir,
            keep_free=keep_free_segments,
            start_timeout=self.start_timeout, call_timeout=self.call_timeout,
            shutdown_grace=check_grace(shutdown_grace), rank_output=rank_output, ray=ray)
        self._state = [NEW]  # a list, shared with the finalizer
        self._failure: BaseException | None = None
        self._lock = threading.RLock()
        self._turn = threading.Condition(self._lock)  # an open stream ended
        # The open stream or async call (weakly: dropping a stream leaves it); no other
        # call starts meanwhile.
        self._open: weakref.ref[Any] | None = None
        self._tasks: asyncio.Lock | None = None  # async callers take turns here
        self._tasks_loop: asyncio.AbstractEventLoop | None = None
        self._abandoned: PendingCall | None = None  # a stream left early, still running
        self._finalizer = weakref.finalize(self, _close, self._transport, self._state)
        self._timings = Recorder(world_size)

    # -- properties -----------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def healthy(self) -> bool:
        """True between a successful start() and a crash, timeout, desync or shutdown.
        Only reads: a rank that died while idle is reported by the next call."""
        return self._state[0] == READY and not self._transport.dead()

    # -- timings (reactor_dist.timings) ------------------------------------------------------
    @property
    def last_timings(self) -> CallTimings | None:
        """Where the seconds of the latest answered call went: ``wall``, ``compute`` (per
        rank), ``slowest_rank``, ``encode``, ``wait``, ``decode``; None before the first."""
        return self._timings.last

    @property
    def record_timings(self) -> bool:
        """Whether calls are timed (default: on; ``REACTOR_DIST_TIMINGS=0`` turns it off)."""
        return self._timings.enabled

    @record_timings.setter
    def record_timings(self, on: bool) -> None:
        self._timings.enabled = bool(on)

    def stats(self, reset: bool = False) -> Stats:
        """Per-rank compute and the overhead (count, p50, p90, p99) over the calls since
        start or the last reset (the latest 10,000 of them); ``str()`` is a table."""
        return self._timings.stats(reset)

    def reset_stats(self) -> None:
        """Forget the calls that stats() summarises."""
        self._timings.reset()

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        """Start every rank and return once each finished load()."""
        with self._lock:
            if self._state[0] != NEW:
                raise RuntimeError("a DistributedRunner starts once; build a new one to restart")
            self._state[0] = UNUSABLE  # until proven otherwise
            try:
                self._transport.start(self.start_timeout)
            except BaseException as exc:
                self._failure = exc
                self._transport.close(graceful=False)
                self._state[0] = CLOSED
                raise
            self._state[0] = READY
            self._warn_if_no_cuda()

    def _warn_if_no_cuda(self) -> None:
        """gpus= or device="auto" on a machine without CUDA: the ranks run on CPU."""
        global _warned_auto_cpu
        if "cpu" not in self._transport.devices:
            return
        if self._gpus is not None:
            log.warning("gpus=%s was given, but the ranks see no CUDA device: they run on "
                        "CPU (pass device=\"cuda\" to make that an error)", self._gpus)
        elif self._device == "auto" and not _warned_auto_cpu:
            _warned_auto_cpu = True  # once per process: CPU is a normal place to develop
            log.warning("device=\"auto\" found no CUDA device: the ranks run on CPU "
                        "(pass device=\"cpu\" to say so and silence this)")

    def generate(self, input: Any, /, *,
                 timeout: float | None | EllipsisType = ...) -> Any:
        """Run ``generate(input)`` on every rank; rank 0's result, or the contract's error."""
        return self._call(Method.GENERATE, input, timeout)

    def stream(self, input: Any, /, *,
               timeout: float | None | EllipsisType = ...) -> Stream:
        """Run ``generate(input)`` on every rank; iterate rank 0's items as they are made.

        ``timeout`` bounds the wait for each next item and for the end of the step.
        Leaving early lets the step finish on every rank and drops the rest unread."""
        timeout = self.call_timeout if timeout is ... else _check_timeout("timeout", timeout)
        with self._lock:
            stream = Stream(self, self._send(Method.GENERATE, input, timeout))
            self._open = weakref.ref(stream)
            return stream

    def reset(self, *, timeout: float | None | EllipsisType = ...) -> None:
        """Run ``reset()`` on every rank (clear session state, keep weights)."""
        self._call(Method.RESET, None, timeout)

    def wait_idle(self, timeout: float | None | EllipsisType = ...) -> bool:
        """Wait until the ranks finished every interrupted call (Ctrl-C during a call
        leaves them running it): True once idle, False when ``timeout`` (default
        ``call_timeout``, None: no limit) ran out first; the runner stays usable either way."""
        timeout = self.call_timeout if timeout is ... else _check_timeout("timeout", timeout)
        with self._lock:
            if self._state[0] != READY:
                self._check_usable()  # raises
            try:
                return self._transport.wait_idle(timeout)
            except WorkerCrashed as exc:
                self._break(exc)
                raise

    # -- asyncio ------------------------------------------------------------------------------
    async def astart(self) -> None:
        """:meth:`start`, in a worker thread: the event loop keeps running meanwhile."""
        await asyncio.to_thread(self.start)

    async def agenerate(self, input: Any, /, *,
                        timeout: float | None | EllipsisType = ...) -> Any:
        """:meth:`generate` for a task: the loop never blocks, tasks take turns in order."""
        timeout = self.call_timeout if timeout is ... else _check_timeout("timeout", timeout)
        return await aio.call(self, Method.GENERATE, input, timeout)

    async def areset(self, *, timeout: float | None | EllipsisType = ...) -> None:
        """:meth:`reset` for a task."""
        timeout = self.call_timeout if timeout is ... else _check_timeout("timeout", timeout)
        await aio.call(self, Method.RESET, None, timeout)

    def astream(self, input: Any, /, *,
                timeout: float | None | EllipsisType = ...) -> aio.AsyncStream:
        """:meth:`stream` for ``async for``; the call starts at the first item awaited."""
        timeout = self.call_timeout if timeout is ... else _check_timeout("timeout", timeout)
        return aio.AsyncStream(self, input, timeout)

    async def ashutdown(self) -> None:
        """:meth:`shutdown`, in a worker thread (it may wait for the ranks' grace)."""
        await asyncio.to_thread(self.shutdown)

    async def __aenter__(self) -> DistributedRunner:
        if self._state[0] == NEW:
            await self.astart()
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.ashutdown()

    def _task_lock(self) -> asyncio.Lock:
        """The turn of async callers, one lock per event loop (a runner may outlive one)."""
        loop = asyncio.get_running_loop()
        if self._tasks is None or self._tasks_loop is not loop:
            self._tasks, self._tasks_loop = asyncio.Lock(), loop
        return self._tasks

    def shutdown(self) -> None:
        """End every rank and remove every file. Idempotent; also runs at exit."""
        with self._lock:
            self._finalizer()

    def __enter__(self) -> DistributedRunner:
        if self._state[0] == NEW:
            self.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return (f"<DistributedRunner {self._worker_name} world_size={self._world_size} "
                f"state={self._state[0]}>")

    # -- one call ---------------------------------------------------------------------------
    def _call(self, method: str, value: Any, timeout: Any) -> Any:
        timeout = self.call_timeout if timeout is ... else _check_timeout("timeout", timeout)
        with self._lock:
            pending = self._send(method, value, timeout)
            try:
                self._transport.collect(pending)
            except (WorkerCrashed, WorkerTimeout) as exc:
                self._break(exc)
                raise  # keeps its __cause__: a rank's exception behind a timeout
            return self._answer(pending)

    def _answer(self, pending: PendingCall) -> Any:
        """The value of a call every rank answered, or the contract's error (which may
        leave the runner unusable); records the call's timings."""
        answered = perf_counter()
        try:
            verdict = judge(pending.method, self._transport.outcomes(pending))
        finally:
            timings = self._timings
            if timings.enabled:
                timings.record(pending.started, pending.sent, answered, perf_counter(),
                               self._transport.compute(pending))
        if verdict.error is None:
            return verdict.value
        if verdict.breaks:
            self._break(verdict.error)
        raise verdict.error

    def _send(self, method: str, value: Any, timeout: float | None) -> PendingCall:
        """Under the lock: once no stream is open and an abandoned one ended, publish.
        Another thread's open stream is waited for at most ``timeout`` (TimeoutError;
        the runner stays healthy)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._open is not None:
            holder = self._open()
            if holder is None:  # a stream collected: it has left (and said so) or is leaving
                self._open = None
                break
            if holder.thread == threading.get_ident():
                raise RuntimeError(
                    f"{holder.what} is still open in this thread: iterate it to the end or "
                    f"close() it (or await it) before the next call")
            what = holder.what
            del holder
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(
                    f"{what} is still open in another thread after {timeout:g} s: this call "
                    f"waited for it and gave up (nothing was sent; the runner stays healthy)")
            self._turn.wait(slice_of(left))  # then loops: Condition.wait has a maximum
        if self._state[0] != READY:
            self._check_usable()  # raises
        try:
            if self._abandoned is not None:
                self._finish_abandoned()
            return self._transport.send(method, value, timeout)
        except (WorkerCrashed, WorkerTimeout) as exc:
            self._break(exc)
            raise  # keeps its __cause__

    def _finish_abandoned(self) -> None:
        """Wait for the end of a stream left early; its outcome only matters if the
        ranks fell out of step."""
        pending, self._abandoned = self._abandoned, None
        assert pending is not None
        verdict = judge(pending.method, self._transport.finish(pending))
        if verdict.breaks:
            raise self._break(verdict.error)

    def _check_usable(self) -> None:
        state = self._state[0]
        if state == NEW:
            raise RuntimeError("start() has not run: call runner.start() (or use `with runner:`)")
        if state != READY:
            why = f": {type(self._failure).__name__}: {self._failure}" if self._failure else \
                " (it was shut down)"
            raise RuntimeError(
                f"this DistributedRunner is unusable{why}. It never restarts ranks; build and "
                f"start a new one") from self._failure

    def _break(self, exc: BaseException) -> BaseException:
        self._failure = exc
        self._state[0] = UNUSABLE
        return exc
