"""``DistributedRunner``: the public API and the error contract (DESIGN.md sections 2, 3).

States::

    new --start()--> ready --crash / timeout / desync--> unusable
     |                 |                                    |
     +-----------------+------------- shutdown() ---------> closed

Only ``ready`` accepts calls.  An unusable or closed runner refuses every call
at once with a RuntimeError that says "unusable" and chains the failure that
made it so; it never restarts a rank nor replays a step.  The transport
(processes, sockets, shared memory) lives in :mod:`reactor_dist.group`.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Sequence
from types import EllipsisType
from typing import Any

from . import transfer, wire
from .errors import RankDesync, WorkerCrashed, WorkerTimeout, rebuild_exception
from .group import RankGroup
from .shm import DEFAULT_DIR
from .validation import check_load_kwargs, check_methods, check_world_size, locate

NEW, READY, UNUSABLE, CLOSED = "new", "ready", "unusable", "closed"


def _check_timeout(name: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{name} must be a positive number of seconds or None, got {value!r}")
    return float(value)


def _close_group(group: RankGroup, state: list[str]) -> None:
    """Finalizer (also at interpreter exit): never leave a process or a file behind."""
    graceful = state[0] == READY
    state[0] = CLOSED
    try:
        group.close(graceful=graceful)
    except BaseException:
        # Interrupted (Ctrl-C while a rank takes its grace period): the finalizer has
        # fired and will not run again, so end the rest now, without grace.
        group.close(graceful=False)
        raise


class DistributedRunner:
    """Runs ``worker_cls`` in ``world_size`` rank processes; every call reaches every rank.

    Options past the Reactor API: ``device`` ("auto", "cpu" or "cuda"), ``gpus``
    (physical GPU ids, one per rank; sets CUDA_VISIBLE_DEVICES), ``env`` (extra
    environment of the ranks), ``launch_prefix`` (wraps each rank's command,
    ``{rank}`` substituted), ``shm_dir``, ``keep_free_segments`` (idle warm
    segments each pool keeps) and ``shutdown_grace`` (seconds a healthy group
    gets to exit before SIGTERM).
    """

    def __init__(self, worker_cls: type, *, world_size: int = 1,
                 load_kwargs: dict[str, Any] | None = None, call_timeout: float | None = 30.0,
                 start_timeout: float | None = 3600.0, init_process_group: bool = True,
                 device: str = "auto", gpus: Sequence[int] | None = None,
                 env: dict[str, str] | None = None, launch_prefix: Sequence[str] = (),
                 shm_dir: str = DEFAULT_DIR, keep_free_segments: int = 2,
                 shutdown_grace: float = 5.0) -> None:
        self._world_size = check_world_size(world_size)
        check_methods(worker_cls)
        where = locate(worker_cls)
        kwargs = check_load_kwargs(load_kwargs)
        self.call_timeout = _check_timeout("call_timeout", call_timeout)
        self.start_timeout = _check_timeout("start_timeout", start_timeout)
        if device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
        if gpus is not None:
            gpus = [int(g) for g in gpus]
            if len(gpus) < world_size:
                raise ValueError(f"gpus={gpus} names {len(gpus)} GPUs for {world_size} ranks; "
                                 f"give one GPU per rank")
        env = {str(k): str(v) for k, v in (env or {}).items()}
        if where["module"] == "__main__":
            # Ranks define __main__'s classes as __mp_main__ (like multiprocessing): alias
            # it here so their pickles (results, exceptions) resolve in this process.
            sys.modules.setdefault("__mp_main__", sys.modules["__main__"])
        self._worker_name = f"{worker_cls.__module__}.{worker_cls.__qualname__}"
        self._group = RankGroup(
            worker=where, world_size=world_size, load_kwargs=kwargs,
            init_process_group=bool(init_process_group), device=device, gpus=gpus, env=env,
            launch_prefix=[str(p) for p in launch_prefix], shm_dir=shm_dir,
            keep_free=keep_free_segments,
            start_timeout=self.start_timeout or 365 * 24 * 3600.0,
            shutdown_grace=shutdown_grace)
        self._state = [NEW]  # a list, shared with the finalizer
        self._failure: BaseException | None = None
        self._lock = threading.RLock()
        self._finalizer = weakref.finalize(self, _close_group, self._group, self._state)

    # -- properties -----------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def healthy(self) -> bool:
        """True between a successful start() and a crash, timeout, desync or shutdown."""
        if self._state[0] != READY:
            return False
        dead = self._group.any_dead()
        if dead:
            self._break(self._group.crashed(dead, "an idle moment between calls"))
            return False
        return True

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        """Start every rank and return once each finished load()."""
        with self._lock:
            if self._state[0] != NEW:
                raise RuntimeError("a DistributedRunner starts once; build a new one to restart")
            self._state[0] = UNUSABLE  # until proven otherwise
            try:
                self._group.start(self.start_timeout)
            except BaseException as exc:
                self._failure = exc
                self._group.close(graceful=False)
                self._state[0] = CLOSED
                raise
            self._state[0] = READY

    def generate(self, input: Any, /, *,
                 timeout: float | None | EllipsisType = ...) -> Any:
        """Run ``generate(input)`` on every rank; rank 0's result, or the contract's error."""
        return self._call("generate", input, timeout)

    def reset(self, *, timeout: float | None | EllipsisType = ...) -> None:
        """Run ``reset()`` on every rank (clear session state, keep weights)."""
        self._call("reset", None, timeout)

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
            if self._state[0] != READY:
                self._check_usable()  # raises
            dead = self._group.idle_deaths()
            if dead:
                raise self._break(self._group.crashed(dead, "an idle moment between calls"))
            seq = self._group.send_call(method, value)  # raises before sending, runner healthy
            what = f"{method}() (call {seq})"
            try:
                replies = self._group.collect(wire.REPLY, seq, timeout, what)
            except (WorkerCrashed, WorkerTimeout) as exc:
                raise self._break(exc) from None
            return self._outcome(method, replies)

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

    def _result(self, method: str, header: dict, body: list) -> Any:
        if method != "generate":
            return None
        try:
            return transfer.decode(header.get("d"), body, self._group.result_base)
        except Exception as exc:
            if hasattr(exc, "add_note"):
                exc.add_note("(while unpickling rank 0's result in the caller; the runner "
                             "stays healthy)")
            raise

    def _break(self, exc: BaseException) -> BaseException:
        self._failure = exc
        self._state[0] = UNUSABLE
        return exc

    def _outcome(self, method: str, replies: dict[int, tuple[dict, list]]) -> Any:
        if [h.get("st") for h, _ in replies.values()].count(wire.OK) == self._world_size:
            return self._result(method, *replies[0])  # every rank returned: the common case
        raised = {r: replies[r] for r in sorted(replies) if replies[r][0].get("st") == wire.RAISED}
        if replies[0][0].get("st") == wire.UNDELIVERABLE:
            header, body = replies[0]
            if not raised:
                # Every rank finished the step; only delivery failed: still in sync.
                raise rebuild_exception(header["e"], body[0] or None, 0)
            raised = {0: replies[0], **raised}  # judged with the others' exceptions
        if not raised:
            return self._result(method, *replies[0])
        errors = {r: rebuild_exception(h["e"], b[0] or None, r) for r, (h, b) in raised.items()}
        if len(raised) == self._world_size:
            types = {r: h["e"]["type"] for r, (h, _) in raised.items()}
            if len(set(types.values())) == 1:
                raise errors[0]
            named = ", ".join(f"rank {r} raised {t}" for r, t in types.items())
            desync = RankDesync(f"ranks raised different exception types in {method}(): {named}")
        else:
            first = next(iter(raised))
            ok = [r for r in range(self._world_size) if r not in raised]
            desync = RankDesync(
                f"rank {first} raised {raised[first][0]['e']['type']} in {method}() while rank "
                f"{', '.join(map(str, ok))} returned: the ranks are out of step")
        first = next(iter(errors))
        desync.__cause__ = errors[first]
        desync.rank_errors = errors  # type: ignore[attr-defined]
        raise self._break(desync)
