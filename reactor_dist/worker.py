"""The optional base class of a worker: one instance per rank, in its own process; and
how a rank finds the worker class (:func:`import_worker_class`).

Any module-level class with a no-argument constructor and ``load``,
``generate`` and ``reset`` works; this base adds the attributes the runner sets
before ``load()`` and :meth:`DistributedWorker.shared_empty`.
"""

from __future__ import annotations

import importlib
import os
import runpy
import sys
import types
from typing import Any

import numpy as np

from .device import usable_cores
from .errors import MainGuardMissing
from .wire.protocol import WorkerRef


class DistributedWorker:
    """One rank of a parallel model.

    ``rank``, ``world_size`` and ``device`` are set by the runner before
    ``load()``.  ``generate`` runs on every rank with the same input; only rank
    0's return value reaches the caller.  A spare (``DistributedRunner(spares=N)``)
    loads with ``rank`` None and ``is_spare`` true, and gets its rank just before the
    ``rejoin()`` in which it takes a dead rank's place.  With
    ``DistributedRunner(snapshot_every=K)`` a worker also defines ``snapshot(self)``
    (this rank's session state, not its weights) and ``restore(self, state)``: every
    restart puts the session back (:mod:`reactor_dist.caller.session`).
    """

    rank: int | None = 0
    world_size: int = 1
    device: str = "cpu"
    is_spare: bool = False
    _reactor_allocate = None  # set by the rank's serve loop: rank 0's shared-memory allocator
    _reactor_progress = None  # set by the rank's serve loop: sends Kind.PROGRESS
    _reactor_to_device = None  # set by the rank's serve loop: inputs to the GPU (staging.py)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def load(self, **load_kwargs: Any) -> None:
        """Build the model once; weights stay loaded between calls."""

    def report_progress(self, done: float, total: float | None = None, unit: str = "") -> None:
        """From ``load()``: say how far it got (``self.report_progress(3, 10, "shards")``);
        the caller sees it while ``start()`` waits (a progress bar in a terminal, else
        log records).  Reports closer than 50 ms apart are dropped, but never the last
        one (``done >= total``).  Outside a rank it does nothing."""
        report = self._reactor_progress
        if report is not None:
            report(done, total, unit)

    def generate(self, input: Any, /) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must implement generate()")

    def reset(self) -> None:
        """Clear per-session state, keep weights."""

    def shared_empty(self, shape: int | tuple[int, ...], dtype: Any = np.uint8) -> np.ndarray:
        """An uninitialised array in shared memory: returning it costs no copy at all.

        Fill it (``torch.from_numpy(buf).copy_(gpu_tensor)``), return it (or an
        object holding it) from ``generate``, and do not write to it afterwards:
        the caller reads the same memory.  On ranks other than 0, whose results
        are discarded, it is an ordinary array.  Raises SharedMemoryExhausted
        when /dev/shm cannot hold it.
        """
        allocate = self._reactor_allocate
        if allocate is None or self.rank != 0:
            return np.empty(shape, dtype)
        return allocate(shape, dtype)

    def to_device(self, x: Any, non_blocking: bool = True) -> Any:
        """``x`` (an input's numpy array or CPU tensor) as a tensor on ``self.device``:
        ``torch.from_numpy(x).to(self.device, non_blocking=non_blocking)``, but at the
        host-to-device floor where ``x`` arrived through shared memory (copied from a
        page-locked mapping of it, registered once per segment).  A write of the worker
        to ``x`` is seen: those bytes are copied the ordinary way.  Outside a rank it
        is the plain line above."""
        to_device = self._reactor_to_device
        if to_device is not None:
            return to_device(x, non_blocking)
        import torch

        tensor = x if isinstance(x, torch.Tensor) else torch.from_numpy(x)
        return tensor.to(self.device, non_blocking=non_blocking)


def share_cpu_cores(world_size: int, device: str) -> None:
    """On CPU, give this rank its share of the cores instead of all of them; call it in
    ``load()`` as ``share_cpu_cores(self.world_size, self.device)``.

    torch starts one intra-op thread per core in every process, so N CPU ranks would run
    N times too many threads and fight over the cores (on 2 cores, 2 ranks ran a video
    step ~2.5x slower). ``torchrun`` sets ``OMP_NUM_THREADS=1`` for the same reason; an
    ``OMP_NUM_THREADS`` the user set is respected, and on a GPU it does nothing.
    """
    if device != "cpu" or "OMP_NUM_THREADS" in os.environ:
        return
    import torch

    torch.set_num_threads(max(1, usable_cores() // world_size))


# Set in a rank while it runs the user's script again as ``__mp_main__``: a runner
# built then means the script lacks its ``if __name__ == "__main__":`` guard.
_rerunning_main: WorkerRef | None = None


def check_not_rerunning_main() -> None:
    """Raise MainGuardMissing when called while a rank re-runs the user's script."""
    where = _rerunning_main
    if where is None:
        return
    script = where.main_path or f"-m {where.main_module}"
    raise MainGuardMissing(
        f"a DistributedRunner was built while a rank re-ran your script ({script}) to find "
        f"{where.qualname}: the script has no `if __name__ == \"__main__\":` guard. Put the "
        f"code that builds and uses the runner under `if __name__ == \"__main__\":`; the "
        f"worker class stays at module level")


def import_worker_class(where: WorkerRef) -> type:
    """In a rank: find the class the way multiprocessing's spawn finds ``__main__``'s
    objects (the script is run again as ``__mp_main__``, its guard keeps it quiet)."""
    global _rerunning_main
    if where.module == "__main__":
        main = types.ModuleType("__mp_main__")
        _rerunning_main = where
        try:
            if where.main_module is not None:
                content = runpy.run_module(where.main_module, run_name="__mp_main__",
                                           alter_sys=True)
            else:
                content = runpy.run_path(str(where.main_path), run_name="__mp_main__")
        finally:
            _rerunning_main = None
        main.__dict__.update(content)
        sys.modules["__main__"] = sys.modules["__mp_main__"] = main
        obj: Any = main
    else:
        obj = importlib.import_module(where.module)
    for index, part in enumerate(where.qualname.split(".")):
        if index == 0 and not hasattr(obj, part):
            from .main_guard import not_found

            raise not_found(where)  # defined where ranks do not run (the main guard)
        obj = getattr(obj, part)
    return obj
