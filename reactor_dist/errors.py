"""The exceptions of the error contract (stated once, in docs/errors-and-recovery.md,
"The error contract"), and how a rank's exception survives the trip to the caller.

A rank's exception is pickled with its type, args and formatted traceback.  The
caller gets the same type and args back with the remote traceback attached as
``__cause__`` (the way ``concurrent.futures`` does it).  An exception that cannot
be pickled or unpickled is replaced by :class:`RemoteError`, which still names the
original type, message and traceback.
"""

from __future__ import annotations

import errno
import pickle
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any

from .wire.protocol import ErrorRecord


@dataclass(frozen=True)
class RankInfo:
    """One rank as the runner knows it: which process is which rank, and where
    (``runner.ranks``: one per rank)."""

    rank: int
    # The process that runs the rank's code (under a launch_prefix that wraps it, not
    # the wrapper); None: a Ray-placed rank that its host has not started yet.
    pid: int | None
    host: str  # the hostname of the node it runs on
    device: str | None  # "cpu", "cuda:0", ...: None before its load() said
    alive: bool


@dataclass(frozen=True)
class RankFailure(RankInfo):
    """One rank involved in a failure (``WorkerCrashed``, ``WorkerTimeout``,
    ``RankDesync``: their ``failures``), and the call it failed in.

    It extends :class:`RankInfo` rather than making its fields optional there: a
    failure is the rank's record at the moment it failed plus what went wrong, so its
    fields stay flat (``failure.pid``) and code that logs or lists ranks takes either,
    while ``runner.ranks`` carries no exit code or error that could mean nothing."""

    exitcode: int | None = None  # it exited with this code (None: it did not exit)
    signal: int | None = None  # a signal ended it: a signal.Signals where Python knows it
    stopped: bool = False  # stopped (SIGSTOP, a debugger): it cannot answer until resumed
    output: tuple[str, ...] = ()  # its last output lines, as the crash report shows them
    error: BaseException | None = field(default=None, compare=False)  # what it raised
    call_seq: int | None = None  # the failed call's number; None: outside a call (start())
    method: str | None = None  # the failed call's method ("generate", "reset")
    # The collective it is in or was last in, in that call, as its ring says
    # ("waits in all_reduce #2 of call 7 ([4] float32) for 4.0 s"); None: none recorded
    collective: str | None = None


class ReactorDistError(Exception):
    """The base of every exception reactor_dist raises itself: ``except ReactorDistError``
    catches any runner failure.  Each subclass also keeps its standard base (RuntimeError,
    TimeoutError, MemoryError), so older ``except`` clauses still catch it."""


class WorkerCrashed(ReactorDistError, RuntimeError):
    """A rank died (its process exited, or a signal or the OOM killer ended it), and its
    worker with it. The runner is unusable.

    ``failures``: one :class:`RankFailure` per dead rank (its exit code or signal, its
    last lines, the call), so that an application decides without reading the text."""

    failures: tuple[RankFailure, ...] = ()  # replaced per instance


class CudaContextBroken(WorkerCrashed):
    """A rank raised a CUDA error that leaves its process's CUDA context unusable (an
    illegal memory access, a device-side assert: every later CUDA call of that process
    fails).  Its process still runs, but the runner counts the rank as lost: the runner
    is unusable, and the restart (``restart()`` or ``max_restarts``) replaces that
    process, with a spare where one waits, while the other ranks may keep theirs.

    ``failures``: one :class:`RankFailure` per such rank, its exception as ``error``;
    ``__cause__``: the first one's exception."""


class WorkerTimeout(ReactorDistError, TimeoutError):
    """Some ranks did not answer within the timeout. The runner is unusable.

    When other ranks raised meanwhile, ``rank_errors`` maps each of them to its
    exception (the first is ``__cause__``); else it is empty.  ``failures``: a
    :class:`RankFailure` per silent rank (``stopped`` where it is), then one per rank
    that raised (its ``error`` set).  A TimeoutError is an OSError: catch
    ReactorDistError (or WorkerTimeout) before a broad ``except OSError``."""

    rank_errors: dict[int, BaseException] = {}  # replaced per instance
    failures: tuple[RankFailure, ...] = ()  # replaced per instance


class RankDesync(ReactorDistError, RuntimeError):
    """Ranks disagreed on the outcome of one call. The runner is unusable.

    ``rank_errors`` maps each rank that raised to its exception; ``failures`` has a
    :class:`RankFailure` for each of them, its exception as ``error``."""

    rank_errors: dict[int, BaseException] = {}  # replaced per instance
    failures: tuple[RankFailure, ...] = ()  # replaced per instance


class CallQueueFull(ReactorDistError, TimeoutError):
    """A call waited its whole ``timeout`` for a place among the ``max_in_flight`` calls
    in flight.  Nothing was sent and the ranks are fine: the runner stays healthy."""


class SharedMemoryExhausted(ReactorDistError, MemoryError):
    """/dev/shm cannot hold a segment for a payload. Nothing was sent; the runner stays
    healthy.  (Formerly ``SharedSlotAllocationFailed``, still importable as a deprecated
    alias.)"""


_DEPRECATED = {"SharedSlotAllocationFailed": "SharedMemoryExhausted"}


def deprecated_name(module: str, name: str) -> type:
    """The class a deprecated name stands for, with a DeprecationWarning that names the
    new one (``module.__getattr__`` of this module and of the package)."""
    if name not in _DEPRECATED:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    new = _DEPRECATED[name]
    warnings.warn(f"{name} is deprecated: use {new} (the same class)", DeprecationWarning,
                  stacklevel=3)
    return globals()[new]


def __getattr__(name: str) -> type:
    return deprecated_name(__name__, name)


class MainGuardMissing(ReactorDistError, RuntimeError):
    """A rank re-ran the user's script and reached a DistributedRunner: the script
    lacks ``if __name__ == "__main__":``.  start() raises it in the caller."""


class FileLimitTooLow(ReactorDistError, OSError):
    """The open files limit (RLIMIT_NOFILE) leaves too little room for the runner's
    sockets, pipes and segments; start() raises it before anything starts.  Its
    ``errno`` is EMFILE; the message says the numbers and how to raise the limit."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.errno = errno.EMFILE


class PlacementFailed(ReactorDistError, RuntimeError):
    """The ranks could not be placed: Ray found no cluster, or one that lacks the
    resources the message names (placement="ray"; nothing stays reserved), or ranks that
    another launcher starts did not join in time (placement="external": the message
    names the missing ranks and those that joined).  start() and restart() raise it."""


class RemoteError(ReactorDistError, RuntimeError):
    """Stands in for a rank's exception that could not cross the process boundary."""

    def __init__(self, type_name: str, message: str, traceback_text: str,
                 reason: str = "") -> None:
        why = f" (a RemoteError stands in for {type_name}: {reason})" if reason else ""
        super().__init__(f"{type_name}: {message}{why}")
        self.type_name = type_name
        self.message = message
        self.traceback_text = traceback_text
        self.reason = reason  # why the original could not cross

    def __reduce__(self):  # keeps the four fields through a pickle round trip
        return (type(self), (self.type_name, self.message, self.traceback_text, self.reason))


class RemoteTraceback(Exception):
    """Carries a rank's formatted traceback; shown as the cause of its exception."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


def type_name(exc: BaseException) -> str:
    cls = type(exc)
    module = cls.__module__
    return cls.__qualname__ if module == "builtins" else f"{module}.{cls.__qualname__}"


def describe(exc: BaseException) -> ErrorRecord:
    """What a rank sends about its exception besides the pickle itself."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        message = str(exc)
    except Exception:  # a broken __str__ must not break the report
        message = f"<unprintable {type(exc).__name__}>"
    return ErrorRecord(type_name(exc), message, tb)


def pickle_exception(exc: BaseException) -> bytes | None:
    """The exception's pickle, or None when it does not pickle (then RemoteError stands in)."""
    saved = exc.__traceback__, exc.__context__, exc.__cause__
    try:
        # Tracebacks never pickle and chained exceptions need not; the text travels apart.
        exc.__traceback__ = exc.__context__ = exc.__cause__ = None
        data = pickle.dumps(exc, protocol=5)
        pickle.loads(data)  # an exception can pickle yet fail to unpickle
        return data
    except Exception:
        return None
    finally:
        exc.__traceback__, exc.__context__, exc.__cause__ = saved


def rebuild_exception(info: ErrorRecord, data: bytes | None, rank: int | str) -> BaseException:
    """The caller-side exception of one rank (or of a spare: ``rank`` its label, "spare 2"):
    the original when possible, else RemoteError."""
    exc: BaseException | None = None
    reason = ("it does not pickle and load again in the rank (an attribute that does not "
              "pickle, or an __init__ whose arguments are not its args)")
    if data is not None:
        try:
            exc = pickle.loads(data)
        except Exception as failed:
            exc = None
            reason = (f"its pickle does not load in this process ({type(failed).__name__}: "
                      f"{failed}; is the class importable here, by the same module name?)")
    if not isinstance(exc, BaseException):
        exc = RemoteError(info.type, info.message, info.traceback,
                          f"{reason}; define it at module level of a module both sides "
                          f"import, its __init__ rebuilt from its args")
    where = rank if isinstance(rank, str) else f"rank {rank}"
    exc.__cause__ = RemoteTraceback(f"\n[{where}] remote traceback:\n{info.traceback}")
    exc.remote_rank = rank if isinstance(rank, int) else None  # type: ignore[attr-defined]
    return exc


def queue_full(method: str, timeout: float | None, in_flight: int, most: int,
               running: str) -> CallQueueFull:
    return CallQueueFull(
        f"{method}() waited {timeout:g} s for its turn: the call queue stayed full "
        f"({in_flight} calls in flight, max_in_flight={most}; the ranks were running "
        f"{running}). Nothing was sent and the runner stays healthy; wait for a result "
        f"first, or raise max_in_flight or the timeout")


def failed_behind(exc: BaseException, what: str, at: str | None) -> BaseException:
    """The error of a call in flight behind the one that broke the runner (``at``): the
    same type, saying which call broke it; the call is never replayed."""
    first = str(exc).split("\n", 1)[0]
    where = f"the runner broke at {at}" if at is not None else "the runner broke"
    text = f"{what} did not run to its end: {where}: {first}"
    try:
        error = type(exc)(text)
    except Exception:  # a type that takes other arguments
        error = RuntimeError(text)
    error.__cause__ = exc
    if getattr(exc, "failures", ()):  # the records of the failure that broke the runner
        error.failures = exc.failures  # type: ignore[attr-defined]
    return error


def timeout_error(headline: str, raised: dict[int, tuple[ErrorRecord, bytes | None]],
                  stacks: str, collectives: Any = None, recorders: str = "") -> WorkerTimeout:
    """A WorkerTimeout whose text and attributes keep what the other ranks did: each
    rank that raised meanwhile (``rank_errors``, the first as ``__cause__``, its message
    and remote traceback in the text); ``collectives`` (a collective_ring.Report): what
    differs between the ranks' collectives first, and each rank's before the stacks;
    ``recorders``: each rank's torch group's flight recorder, a line each, after them."""
    errors = {rank: rebuild_exception(record, data, rank)
              for rank, (record, data) in raised.items()}
    note = ""
    if raised:
        said = "; ".join(f"rank {r} raised {rec.type}: {rec.message}"
                         for r, (rec, _) in raised.items())
        note += f" ({said}: the silent ranks are probably waiting for it in a collective)"
    tracebacks = "".join(f"[rank {r}] remote traceback:\n{rec.traceback.rstrip()}\n"
                         for r, (rec, _) in raised.items())
    first = lines = ""
    if collectives is not None:
        first = f"{collectives.headline}\n" if collectives.headline else ""
        lines = f"the ranks' collectives:{collectives.text()}\n"
    if recorders:
        lines += f"their torch groups' flight recorders:{recorders}\n"
    exc = WorkerTimeout(f"{first}{headline}{note}; the runner is unusable\n{tracebacks}"
                        f"{lines}the silent ranks' stacks:\n{stacks}")
    exc.rank_errors = errors
    if errors:
        exc.__cause__ = next(iter(errors.values()))
    return exc
