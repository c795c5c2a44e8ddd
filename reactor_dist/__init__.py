"""reactor_dist: run one model's parallel inference across the GPUs of one machine
(or, with ``placement="ray"``, of several).

Wrap a worker class in :class:`DistributedRunner`; it starts one process per GPU,
sends every ``generate(input)`` to every rank, waits for all of them and returns
rank 0's result, with frames passed through shared memory and failures reported
as the exceptions below (never as a hang).
"""

from .errors import (
    CallQueueFull,
    FileLimitTooLow,
    MainGuardMissing,
    PlacementFailed,
    RankDesync,
    ReactorDistError,
    RemoteError,
    RemoteTraceback,
    SharedMemoryExhausted,
    WorkerCrashed,
    WorkerTimeout,
)
from .runner import DistributedRunner
from .worker import DistributedWorker, share_cpu_cores

__all__ = [
    "CallQueueFull",
    "DistributedRunner",
    "DistributedWorker",
    "FileLimitTooLow",
    "MainGuardMissing",
    "PlacementFailed",
    "RankDesync",
    "ReactorDistError",
    "RemoteError",
    "RemoteTraceback",
    "SharedMemoryExhausted",
    "WorkerCrashed",
    "WorkerTimeout",
    "share_cpu_cores",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> type:
    """Deprecated names (``SharedSlotAllocationFailed``) still work, with a warning."""
    from .errors import deprecated_name

    return deprecated_name(__name__, name)
