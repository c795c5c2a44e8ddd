"""Construction checks.

Everything here runs in ``DistributedRunner.__init__``, before any process
exists, so that a mistake costs the user an exception, not a hung start-up.
(How a rank finds the worker class again: :func:`reactor_dist.worker.import_worker_class`.)
"""

from __future__ import annotations

import logging
import pickle
import sys
from typing import Any

from ..device import surely_cpu, usable_cores
from ..placement.output import OUTPUT_MODES
from ..wire.protocol import WorkerRef
from ..worker import DistributedWorker

REQUIRED_METHODS = ("load", "generate", "reset")
log = logging.getLogger("reactor_dist")
_warned_auto_cpu = False


COUNTS = {  # each count option: its least value, and what it counts
    "max_in_flight": (1, "calls sent to the ranks and not yet answered; 1: one at a time"),
    "max_restarts": (0, "restarts by itself within restart_window; 0: never"),
    "spares": (0, "loaded processes waiting to take a dead rank's place; 0: none"),
    "snapshot_every": (0, "calls between two snapshots of the session; 0: none"),
}


def check_counts(**counts: Any) -> None:
    """Each count option (:data:`COUNTS`) is an int, at least its least value."""
    for name, value in counts.items():
        least, what = COUNTS[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an int >= {least} ({what}), got {value!r}")


def check_spares(spares: int, worker_cls: type, gpus: list[int] | None,
                 world_size: int) -> None:
    """A spare takes a rank's place through the worker's ``rejoin()``, and holds a GPU
    of its own (``gpus``' entries after the ranks'; with Ray, a bundle of its own)."""
    if not spares:
        return
    if gpus is not None and len(gpus) < world_size + spares:
        raise ValueError(f"gpus={gpus} names {len(gpus)} GPUs for {world_size} ranks and "
                         f"{spares} spare{'s' * (spares != 1)}; give one GPU per rank, then "
                         f"one per spare")
    if not callable(getattr(worker_cls, "rejoin", None)):
        raise ValueError(
            f"spares={spares} needs a rejoin(self) method on {worker_cls.__qualname__}: a "
            f"spare loads with rank None and takes a dead rank's place at a restart, where "
            f"rejoin() runs on it with its new self.rank (define rejoin(), even an empty "
            f"one when nothing in the model depends on the rank; or pass spares=0)")


def check_session(snapshot_every: int, retry_failed: Any, max_restarts: int,
                  worker_cls: type) -> None:
    """Snapshots need both hooks; retrying a failed call needs snapshots (its re-run
    starts from the session's state) and an automatic restart to run it after."""
    if not isinstance(retry_failed, bool):
        raise ValueError(f"retry_failed must be True or False, got {retry_failed!r}")
    if snapshot_every:
        missing = [name for name in ("snapshot", "restore")
                   if not callable(getattr(worker_cls, name, None))]
        if missing:
            raise ValueError(
                f"snapshot_every={snapshot_every} needs snapshot(self) -> state and "
                f"restore(self, state) on {worker_cls.__qualname__}, which lacks "
                f"{' and '.join(missing)}(): snapshot() returns this rank's session state "
                f"(not its weights), restore() puts it back after a restart (or pass "
                f"snapshot_every=0)")
    if retry_failed and (not snapshot_every or max_restarts < 1):
        raise ValueError(
            f"retry_failed=True sends a failed call again after the automatic restart, "
            f"from the session's last snapshot: it needs snapshot_every >= 1 and "
            f"max_restarts >= 1 (got snapshot_every={snapshot_every}, "
            f"max_restarts={max_restarts})")


def check_devices(device: Any, gpus: Any, rank_output: Any,
                  world_size: int) -> list[int] | None:
    """The ``device``, ``gpus`` (one per rank) and ``rank_output`` options; the GPU ids."""
    if rank_output not in OUTPUT_MODES:
        raise ValueError(f"rank_output must be 'stderr' or 'log', got {rank_output!r}")
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if gpus is None:
        return None
    gpus = [int(g) for g in gpus]
    if len(gpus) < world_size:
        raise ValueError(f"gpus={gpus} names {len(gpus)} GPUs for {world_size} ranks; "
                         f"give one GPU per rank")
    check_one_rank_per_gpu(gpus, world_size)
    return gpus


def check_one_rank_per_gpu(gpus: list[int], world_size: int) -> None:
    """Two ranks on one GPU cannot form an NCCL group (and CUDA takes a GPU id named twice
    in CUDA_VISIBLE_DEVICES for none at all); a spare, after the ranks, may share a
    rank's GPU (reactor_dist.caller.spares: it then takes only that rank's place)."""
    ranks = gpus[:world_size]
    for rank, gpu in enumerate(ranks):
        first = ranks.index(gpu)
        if first != rank:
            raise ValueError(
                f"gpus={gpus} puts ranks {first} and {rank} on GPU {gpu}, but NCCL allows "
                f"one rank per GPU: give each of the {world_size} ranks a GPU of its own "
                f"(the first {world_size} entries of gpus distinct), or lower world_size; "
                f"a spare, named after the ranks, may share a rank's GPU (gpus=[0, 1, 0] "
                f"with world_size=2, spares=1: the spare waits on GPU 0)")


def check_placed_options(placement: str, gpus: Any, rank_output: str) -> None:
    """Options that a ``placement="ray"`` or ``"external"`` runner cannot honour."""
    if placement == "ray" and gpus is not None:
        raise ValueError("gpus= and placement='ray' exclude each other: Ray assigns the "
                         "GPUs (ray_bundle); leave gpus out")
    if placement == "ray" and rank_output == "log":
        raise ValueError("rank_output='log' does not apply with placement='ray': Ray "
                         "forwards the ranks' output lines (log_to_driver)")
    if placement == "external" and gpus is not None:
        raise ValueError("gpus= and placement='external' exclude each other: each joined "
                         "rank uses the GPU of its LOCAL_RANK (cuda:LOCAL_RANK, as torchrun "
                         "sets it); leave gpus out")
    if placement == "external" and rank_output == "log":
        raise ValueError("rank_output='log' does not apply with placement='external': each "
                         "rank's output goes to its launcher's log")


def warn_if_cores_short(world_size: int, device: str, placement: str) -> None:
    """More CPU ranks than this process's cores: they all run here and share the cores
    (8 ranks on 2 cores took 11.8 s to start).  Said at construction, before that slow
    start; not for Ray, whose ranks run on other nodes, nor where a GPU may do the work
    (an NVIDIA driver is present: the ranks decide, and warn if they fall back to CPU)."""
    cores = usable_cores()
    if placement != "local" or world_size <= cores or not surely_cpu(device):
        return
    log.warning("world_size=%d: the %d ranks will compute on the CPU, but this process may "
                "use %d CPU core%s, so every rank's calls will share them (a slow start, "
                "slow calls). Pass world_size=%d or less, or run the ranks on GPUs "
                "(device=\"cuda\")", world_size, world_size, cores, "s" * (cores != 1), cores)


def check_world_size(world_size: Any) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(
            f"world_size must be a positive int (one rank per GPU), got {world_size!r} "
            f"of type {type(world_size).__name__}"
        )
    return world_size


def check_methods(cls: Any) -> None:
    if not isinstance(cls, type):
        raise TypeError(f"worker_cls must be a class, got {type(cls).__name__} {cls!r}")
    missing = [name for name in REQUIRED_METHODS if not callable(getattr(cls, name, None))]
    if getattr(cls, "generate", None) is DistributedWorker.generate:
        missing.append("generate")
    if missing:
        raise TypeError(
            f"worker class {cls.__qualname__} is missing {', '.join(missing)}: a worker needs "
            f"load(**load_kwargs), generate(input) and reset()"
        )


def locate(cls: type) -> WorkerRef:
    """Where a fresh interpreter finds ``cls``: module name, qualname, and for
    ``__main__`` the script path or ``-m`` module name.  TypeError when nowhere."""
    qualname, module_name = cls.__qualname__, cls.__module__
    if "<locals>" in qualname:
        raise TypeError(
            f"worker class {qualname} is defined inside a function, so the rank processes "
            f"cannot import it. Move it to the top level of a module."
        )
    module = sys.modules.get(module_name)
    where = WorkerRef(module_name, qualname)
    if module_name == "__main__":
        spec = getattr(module, "__spec__", None)
        path = getattr(module, "__file__", None)
        if spec is not None and spec.name and spec.name != "__main__":
            where = WorkerRef(module_name, qualname, main_module=spec.name)  # python -m app
        elif path == "<stdin>":  # python - <<EOF, python < app.py: no file to run again
            raise TypeError(
                f"worker class {qualname} is defined in a script read from standard input, "
                f"which the rank processes cannot import. Save the script to a file and run "
                f"that (python app.py), or put the worker class in a .py module and import "
                f"it from there."
            )
        elif path:
            where = WorkerRef(module_name, qualname, main_path=path)  # python app.py
        else:
            raise TypeError(
                f"worker class {qualname} is defined in an interactive session or notebook "
                f"cell, which the rank processes cannot import. Put it in a .py module and "
                f"import it from there."
            )
    elif module is None or not (getattr(module, "__file__", None)
                                or getattr(module, "__spec__", None)):
        raise TypeError(f"worker class {qualname}: its module {module_name!r} is not importable")
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    if obj is not cls:
        raise TypeError(
            f"worker class {qualname} is not reachable as {module_name}.{qualname} "
            f"(created dynamically or redefined?); define it once at module level"
        )
    return where


def check_load_kwargs(load_kwargs: Any) -> dict[str, Any]:
    if load_kwargs is None:
        return {}
    if not isinstance(load_kwargs, dict) or not all(isinstance(k, str) for k in load_kwargs):
        raise TypeError(f"load_kwargs must be a dict with str keys, got {load_kwargs!r}")
    for key, value in load_kwargs.items():
        try:
            pickle.dumps(value, protocol=5)
        except Exception as exc:
            raise TypeError(
                f"load_kwargs[{key!r}] cannot be pickled ({type(exc).__name__}: {exc}); "
                f"pass a path or plain data and build the object inside load()"
            ) from None
    return dict(load_kwargs)


def warn_if_no_cuda(devices: list[str], gpus: list[int] | None, device: str) -> None:
    """After start(): gpus= or device="auto" on a machine without CUDA, the ranks run on
    the CPU (``devices``: each rank's)."""
    global _warned_auto_cpu
    if "cpu" not in devices:
        return
    if gpus is not None:
        log.warning("gpus=%s was given, but the ranks see no CUDA device: they run on "
                    "CPU (pass device=\"cuda\" to make that an error)", gpus)
    elif device == "auto" and not _warned_auto_cpu:
        _warned_auto_cpu = True  # once per process: CPU is a normal place to develop
        log.warning("device=\"auto\" found no CUDA device: the ranks run on CPU "
                    "(pass device=\"cpu\" to say so and silence this)")


# Called by the runner itself, never by name: at start (load), at a restart (rejoin),
# for sessions (snapshot, restore).
RUNNERS_OWN = ("load", "rejoin", "snapshot", "restore")


def check_method_name(worker_cls: type, name: Any, form: str, args: tuple,
                      kwargs: dict[str, Any]) -> None:
    """``runner.call(name, ...)`` (``form``: call, call_all, acall, acall_all) runs a
    public method of the worker on every rank: checked before anything is sent, so a
    wrong name leaves the runner as it was."""
    if not isinstance(name, str):
        raise TypeError(f"{form}() takes the name of a worker method as a str, got {name!r}")
    cls = worker_cls.__qualname__
    if name.startswith("_"):
        raise ValueError(f"{form}({name!r}): a private name; {form}() runs a public method "
                         f"of {cls} on every rank (a name without a leading underscore)")
    if name in RUNNERS_OWN:
        raise ValueError(f"{form}({name!r}): {name}() is the runner's to call (load at "
                         f"start, rejoin at a restart, snapshot and restore for sessions); "
                         f"{form}() runs generate, reset and your own methods")
    if not callable(getattr(worker_cls, name, None)):
        public = sorted(n for n in dir(worker_cls) if not n.startswith("_")
                        and n not in RUNNERS_OWN and callable(getattr(worker_cls, n, None)))
        raise AttributeError(f"{form}({name!r}): {cls} has no method {name!r}; {form}() runs "
                             f"a public method the worker class defines: "
                             f"{', '.join(public)}")
    if name == "generate":
        if form.endswith("_all"):
            raise ValueError(f"{form}('generate', ...): generate()'s result is rank 0's; "
                             f"return what every rank should report from a method of your "
                             f"own and {form}() that")
        if len(args) != 1 or kwargs:
            raise TypeError(f"{form}('generate', ...) takes the input alone, as "
                            f"generate(input) does; got {len(args)} positional and "
                            f"{len(kwargs)} keyword arguments")
    if name == "reset" and (args or kwargs):
        raise TypeError(f"{form}('reset') takes no arguments, as reset() does")
