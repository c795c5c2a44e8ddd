"""reactor_dist: run one model's parallel inference across the GPUs of one machine.

Wrap a worker class in :class:`DistributedRunner`; it starts one process per GPU,
sends every ``generate(input)`` to every rank, waits for all of them and returns
rank 0's result, with frames passed through shared memory and failures reported
as the exceptions below (never as a hang).
"""

from .errors import (
    RankDesync,
    RemoteError,
    SharedSlotAllocationFailed,
    WorkerCrashed,
    WorkerTimeout,
)
from .runner import DistributedRunner
from .worker import DistributedWorker

__all__ = [
    "DistributedRunner",
    "DistributedWorker",
    "RankDesync",
    "RemoteError",
    "SharedSlotAllocationFailed",
    "WorkerCrashed",
    "WorkerTimeout",
]
__version__ = "0.1.0"
