"""reactor_dist: run one model's parallel inference across the GPUs of one machine
(or, with ``placement="ray"``, of several).

Wrap a worker class in :class:`DistributedRunner`; it starts one process per GPU,
sends every ``generate(input)`` to every rank, waits for all of them and returns
rank 0's result, with frames passed through shared memory and failures reported
as the exceptions below (never as a hang).

The package imports lazily (PEP 562): a rank, which runs ``python -m reactor_dist.rank``,
needs the worker's side only, so the caller's side (``DistributedRunner`` and the ~25
modules behind it) is imported on first use of the name, not by ``import reactor_dist``.
"""

import importlib
from typing import TYPE_CHECKING, Any

from .errors import (
    CallQueueFull,
    CudaContextBroken,
    FileLimitTooLow,
    MainGuardMissing,
    PlacementFailed,
    RankDesync,
    RankFailure,
    RankInfo,
    ReactorDistError,
    RemoteError,
    RemoteTraceback,
    SharedMemoryExhausted,
    WorkerCrashed,
    WorkerTimeout,
)
from .worker import DistributedWorker, share_cpu_cores

__all__ = [
    "AsyncStream",
    "CallQueueFull",
    "CudaContextBroken",
    "DistributedRunner",
    "DistributedWorker",
    "External",
    "FileLimitTooLow",
    "MainGuardMissing",
    "PlacementFailed",
    "RankDesync",
    "RankFailure",
    "RankInfo",
    "ReactorDistError",
    "RemoteError",
    "RemoteTraceback",
    "SharedMemoryExhausted",
    "Stream",
    "WorkerCrashed",
    "WorkerTimeout",
    "close_rank_templates",
    "set_rank_template_idle",
    "share_cpu_cores",
]
__version__ = "0.1.0"


if TYPE_CHECKING:
    from .caller.aio import AsyncStream
    from .caller.runner import DistributedRunner
    from .caller.stream import Stream
    from .placement.external import External
    from .placement.template import close_rank_templates, set_rank_template_idle

_TEMPLATE_NAMES = ("close_rank_templates", "set_rank_template_idle")
# What runner.stream() and runner.astream() return, for annotations.
_CALLER_NAMES = {"DistributedRunner": ".caller.runner", "Stream": ".caller.stream",
                 "AsyncStream": ".caller.aio", "External": ".placement.external"}


def __getattr__(name: str) -> Any:
    """``DistributedRunner``, the streams it returns and the rank templates' controls on
    first use; deprecated names (``SharedSlotAllocationFailed``) still work, with a
    warning."""
    if name in _CALLER_NAMES:
        module = importlib.import_module(_CALLER_NAMES[name], __name__)
        globals()[name] = getattr(module, name)  # later lookups skip this function
        return globals()[name]
    if name in _TEMPLATE_NAMES:
        from .placement import template

        globals()[name] = getattr(template, name)
        return globals()[name]
    from .errors import deprecated_name

    return deprecated_name(__name__, name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
