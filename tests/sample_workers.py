"""Workers and steps the tests drive.

Each worker class below exists for one behaviour a test needs, set with ``load_kwargs``.
``Echo`` returns what it is sent.  A faulty worker (``Raises``, ``ExitsOnRank``, ...)
misbehaves on the call that sends it ``FAULT``, on the rank it names (every rank where
it names none), and otherwise behaves like ``Echo``, so a test can show that the runner
still answers afterwards.

A runner that must do several kinds of work in one lifetime (the chaos, soak, transfer
and Ctrl-C tests) is sent *steps*: small objects (``Sleep``, ``FullArray``,
``SharedArray``, ``SpawnChild``, ...) whose ``run()`` is the work.  ``Echo`` and every
worker built on it runs a step it is sent and returns the step's result.
"""

from __future__ import annotations

import ctypes
import dataclasses
import faulthandler
import os
import signal
import subprocess
import sys
import time

import numpy as np

from reactor_dist import DistributedWorker

FAULT = "fault"  # the input on which a faulty worker misbehaves


def is_fault(x) -> bool:
    return type(x) is str and x == FAULT


def hang() -> None:
    while True:
        time.sleep(0.05)


class Unpicklable(Exception):
    """An exception that refuses to pickle (holds a lock)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        import threading

        self.lock = threading.Lock()


class NeedsTwoArgs(Exception):
    """Pickles, but fails to unpickle (the classic custom-__init__ mistake)."""

    def __init__(self, a: str, b: str) -> None:
        super().__init__(f"{a}-{b}")


class BadSetState:
    """Pickles fine; unpickling raises (in whichever process unpickles it)."""

    def __reduce__(self):
        return (_explode, ("BadSetState cannot be rebuilt",))


def _explode(message: str):
    raise ValueError(message)


# -- steps: work a rank does in one call ------------------------------------------------------
class Step:
    """What ``Echo`` runs instead of returning: ``run(worker)`` is the rank's work."""

    def run(self, worker: Echo):
        raise NotImplementedError


@dataclasses.dataclass
class Sleep(Step):
    """A call that takes a while: sleep ``seconds``, then return ``value``."""

    seconds: float
    value: object = None

    def run(self, worker: Echo):
        time.sleep(self.seconds)
        return self.value


@dataclasses.dataclass
class Gate(Step):
    """A call that lasts until the test lets it end: wait until ``flag`` exists (at most
    ``seconds``), then return ``value``; a test knows the call still runs without timing
    it."""

    flag: str
    seconds: float
    value: object = None

    def run(self, worker: Echo):
        deadline = time.monotonic() + self.seconds
        while not os.path.exists(self.flag) and time.monotonic() < deadline:
            time.sleep(0.005)
        return self.value


@dataclasses.dataclass
class FullArray(Step):
    """A result made on the rank: a fresh numpy array (copied into shared memory)."""

    shape: tuple | list
    fill: int | float = 1
    dtype: str = "u1"

    def run(self, worker: Echo):
        return np.full(self.shape, self.fill, dtype=self.dtype)


@dataclasses.dataclass
class SlowArray(FullArray):
    """A fresh numpy array, returned after ``seconds``."""

    seconds: float = 0.0

    def run(self, worker: Echo):
        time.sleep(self.seconds)
        return super().run(worker)


class SharedArray(FullArray):
    """A result built in shared memory by ``shared_empty`` (sent without a copy)."""

    def run(self, worker: Echo):
        out = worker.shared_empty(self.shape, self.dtype)
        out[...] = self.fill
        return out


@dataclasses.dataclass
class SpawnChild(Step):
    """Starts a child process that sleeps 600 s and returns its pid; ``detached`` puts it
    in a session of its own, so that killing the rank's process group alone misses it."""

    detached: bool = False

    def run(self, worker: Echo):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                                 start_new_session=self.detached)
        worker.children.append(child)
        return child.pid


@dataclasses.dataclass
class WriteInput(Step):
    """Every rank but 0 overwrites the ``value`` it received at once; rank 0 looks
    ``delay`` seconds later and returns what it sees (it must not see their writes)."""

    value: np.ndarray
    delay: float = 0.3

    def run(self, worker: Echo):
        if worker.rank != 0:
            self.value[...] = worker.rank + 100
            return None
        time.sleep(self.delay)
        seen = self.value.copy()
        self.value[...] = 100
        return seen


ENVIRONMENT = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "EXTRA", "PREFIXED", "OMP_NUM_THREADS")


@dataclasses.dataclass
class ReportEnvironment(Step):
    """Returns the rank's number, its device and the environment variables it was given."""

    def run(self, worker: Echo):
        return {"rank": worker.rank, "device": worker.device,
                "env": {k: os.environ.get(k) for k in ENVIRONMENT}}


@dataclasses.dataclass
class Say(Step):
    """Each rank prints ``text`` and its rank on stdout."""

    text: str

    def run(self, worker: Echo):
        print(f"{self.text} from rank {worker.rank}", flush=True)


@dataclasses.dataclass
class LateStacks(Step):
    """Rank ``rank`` leaves the runner's SIGUSR1 unanswered, then writes its stacks once
    ``flag`` exists (as a rank stuck in the kernel would, after the timeout was reported),
    and a line that says so; every other rank returns at once."""

    rank: int
    flag: str

    def run(self, worker: Echo):
        if worker.rank != self.rank:
            return None
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        deadline = time.monotonic() + 60
        while not os.path.exists(self.flag) and time.monotonic() < deadline:
            time.sleep(0.01)
        faulthandler.dump_traceback(all_threads=True)
        print("stacks written late", flush=True)


@dataclasses.dataclass
class ProcessFacts(Step):
    """How the rank's process was made (tests/test_template.py): its parentage, process
    group, name, environment, working directory, CPUs, arguments, and a first draw of
    each random generator; every rank's, all_gathered, where the runner formed a group."""

    def run(self, worker: Echo):
        with open("/proc/self/comm") as f:
            comm = f.read().strip()
        torch = sys.modules.get("torch")
        mine = {"rank": worker.rank, "pid": os.getpid(), "ppid": os.getppid(),
                "pgid": os.getpgid(0), "comm": comm, "cwd": os.getcwd(),
                "mark": os.environ.get("REACTOR_DIST_RANK_MARK"),
                "RANK": os.environ.get("RANK"), "own": os.environ.get("TEMPLATE_TEST_VALUE"),
                "cpus": sorted(os.sched_getaffinity(0)), "argv": sys.argv[1:],
                "torch": torch is not None, "numpy_draw": float(np.random.random()),
                "torch_seed": torch.initial_seed() if torch is not None else None}
        if worker.world_size == 1 or torch is None or not torch.distributed.is_initialized():
            return [mine]
        every: list = [None] * worker.world_size
        torch.distributed.all_gather_object(every, mine)
        return every


@dataclasses.dataclass
class AtExit(Step):
    """Each rank registers an atexit handler that appends its rank to ``path``, and
    prints a line it never flushes: what a rank's exit must still do (server.leave)."""

    path: str

    def run(self, worker: Echo):
        import atexit

        def note(rank: int = worker.rank) -> None:
            with open(self.path, "a") as f:
                f.write(f"rank {rank} ran its atexit handler\n")

        atexit.register(note)
        sys.stdout.write(f"rank {worker.rank} unflushed\n")


@dataclasses.dataclass
class GatherEnvironment(Step):
    """ReportEnvironment of every rank, all_gathered over the group (rank order)."""

    def run(self, worker: Echo):
        import torch.distributed as dist

        mine = ReportEnvironment().run(worker)
        every: list = [None] * worker.world_size
        dist.all_gather_object(every, mine)
        return every


@dataclasses.dataclass
class AllGather(Step):
    """A real collective: all_gather of each rank's ``[rank + 1] * 2`` over the group."""

    def run(self, worker: Echo):
        import torch
        import torch.distributed as dist

        mine = torch.full((2,), float(worker.rank + 1))
        parts = [torch.zeros(2) for _ in range(worker.world_size)]
        dist.all_gather(parts, mine)
        return torch.cat(parts).numpy()


@dataclasses.dataclass
class GatherChecksums(Step):
    """Every rank's CRC-32 of ``data``, all_gathered over the group: proves that each rank
    received the same input (placement tests: over TCP to another node)."""

    data: object

    def run(self, worker: Echo):
        import zlib

        import torch
        import torch.distributed as dist

        mine = torch.tensor([zlib.crc32(np.ascontiguousarray(self.data).data)], dtype=torch.int64)
        parts = [torch.zeros(1, dtype=torch.int64) for _ in range(worker.world_size)]
        dist.all_gather(parts, mine)
        return [int(p) for p in parts]


@dataclasses.dataclass
class RaiseBeforeAllReduce(Step):
    """The common tensor-parallel bug: rank ``rank`` raises before an all_reduce that the
    other ranks then wait in."""

    rank: int = 1

    def run(self, worker: Echo):
        import torch
        import torch.distributed as dist

        if worker.rank == self.rank:
            raise ValueError(f"bad shape on rank {worker.rank}: expected (8, 64)")
        dist.all_reduce(torch.ones(1))


@dataclasses.dataclass
class CpuThreads(Step):
    """Calls share_cpu_cores (as a worker's load() would) and returns torch's thread count."""

    def run(self, worker: Echo):
        import torch

        from reactor_dist import share_cpu_cores

        share_cpu_cores(worker.world_size, worker.device)
        return torch.get_num_threads()


# -- workers ----------------------------------------------------------------------------------
class Echo(DistributedWorker):
    """Returns its input (runs a Step); with ``log_dir``, logs each call to rank<N>.log."""

    log_dir: str | None = None

    def load(self, log_dir: str | None = None) -> None:
        self.log_dir = log_dir
        self.children: list[subprocess.Popen] = []

    def log(self, text: str) -> None:
        if self.log_dir:
            with open(os.path.join(self.log_dir, f"rank{self.rank}.log"), "a") as f:
                f.write(text + "\n")

    def generate(self, x, /):
        if isinstance(x, Step):
            self.log(type(x).__name__)
            return x.run(self)
        self.log(f"echo {x!r}"[:200])
        return x

    def reset(self) -> None:
        self.log("reset")


class Faulty(Echo):
    """Base of the faulty workers: for the input ``FAULT``, rank ``rank`` (every rank
    when None) runs ``fault()``; every other call is Echo's."""

    def load(self, rank: int | None = None) -> None:
        super().load()
        self.target = rank

    def generate(self, x, /):
        if is_fault(x) and self.target in (None, self.rank):
            return self.fault()
        return super().generate(x)

    def fault(self):
        raise NotImplementedError


class Raises(Faulty):
    """Raises ``error("boom on rank N")``: the same type everywhere, or on one rank alone."""

    def load(self, error: type[BaseException] = ValueError, rank: int | None = None) -> None:
        super().load(rank)
        self.error = error

    def fault(self):
        raise self.error(f"boom on rank {self.rank}")


class RaisesPerRank(Faulty):
    """Rank N raises ``errors[N]``: ranks that disagree on the exception's type."""

    def load(self, errors: list[type[BaseException]]) -> None:
        super().load()
        self.errors = errors

    def fault(self):
        raise self.errors[self.rank](f"boom on rank {self.rank}")


class RaisesNeedsTwoArgs(Faulty):
    """Raises an exception that pickles on the rank but cannot be unpickled by the caller."""

    def fault(self):
        raise NeedsTwoArgs("left", "right")


class Rank0RaisesOthersHang(Faulty):
    """Rank 0 raises; the others hang, as they would waiting for rank 0 in a collective."""

    def fault(self):
        if self.rank == 0:
            raise ValueError("rank 0 gave up")
        hang()


class ExitsOnRank(Faulty):
    """Prints, writes last words to stderr, then ``os._exit(code)``: a rank that exits."""

    def load(self, rank: int, code: int = 3) -> None:
        super().load(rank)
        self.code = code

    def fault(self):
        print(f"rank {self.rank} about to exit", flush=True)
        sys.stderr.write(f"last words of rank {self.rank}\n")
        sys.stderr.flush()
        os._exit(self.code)


class KillsItselfOnRank(Faulty):
    """Sends itself ``sig`` (SIGKILL by default): a rank killed by a signal."""

    def load(self, rank: int, sig: int = signal.SIGKILL) -> None:
        super().load(rank)
        self.sig = sig

    def fault(self):
        print(f"rank {self.rank} about to be signalled", flush=True)
        os.kill(os.getpid(), self.sig)
        time.sleep(10)


class SegfaultsOnRank(Faulty):
    """Reads address 0: a real SIGSEGV, with faulthandler's dump of the stack."""

    def fault(self):
        ctypes.string_at(0)


class HangsOnRank(Faulty):
    """Never returns from generate(): a rank that hangs."""

    def fault(self):
        hang()


class ReturnsUnpicklableResult(Faulty):
    """Returns a lambda, which the rank cannot pickle to send back."""

    def fault(self):
        return lambda: None


class ReturnsLocalClassInstance(Faulty):
    """Returns an instance of a class defined inside fault(): pickle cannot find the class."""

    def fault(self):
        class Box:
            pass
        return Box()


class ReturnsResultThatCannotBeRebuilt(Faulty):
    """Returns a result that pickles on the rank but raises when the caller unpickles it."""

    def fault(self):
        return BadSetState()


class FailsToLoadOnRank(Echo):
    """load() raises FileNotFoundError on rank ``rank``: weights missing there."""

    def load(self, rank: int) -> None:
        super().load()
        if self.rank == rank:
            raise FileNotFoundError(f"weights missing on rank {self.rank}")


class HangsInLoadOnRank(Echo):
    """load() never returns on rank ``rank``: a start that hangs."""

    def load(self, rank: int) -> None:
        super().load()
        if self.rank == rank:
            time.sleep(3600)


class NoMethods:
    """Not a worker at all: construction must name every missing method."""


class OnlyLoad:
    """A worker with load() alone: construction must name generate and reset."""

    def load(self):
        pass


# -- fault injection (tests/test_faults.py, test_runner_death.py, test_chaos.py) ---------------
#
# A fault is a dict ``{"phase": ..., "rank": r, "means": ..., "stamp_dir": d}``.  It fires
# only in the process whose RANK is ``r`` (or, for ``rank == "caller"``, only in the
# application process whose pid is the fault's ``caller_pid``).  Just before it fires it
# writes ``time.time()`` to ``<stamp_dir>/<phase>-<rank>`` so that a test can measure how
# late the runner reported it.

FAULT_MEANS = ("raise", "exit", "sigkill", "segv", "hang")


class InjectedFault(Exception):
    """What the ``raise`` means raises (pickles; one message argument)."""


def _fault_here(fault: dict) -> bool:
    if fault["rank"] == "caller":
        return os.getpid() == fault.get("caller_pid")
    return os.environ.get("RANK") == str(fault["rank"])


def inject_fault(fault: dict) -> None:
    """Fire ``fault`` in this process: raise, exit 3, SIGKILL, a real SIGSEGV or hang."""
    means, phase = fault["means"], fault["phase"]
    stamp_dir = fault.get("stamp_dir")
    if stamp_dir:
        with open(os.path.join(stamp_dir, f"{phase}-{fault['rank']}"), "w") as f:
            f.write(repr(time.time()))
    print(f"injecting {means} in {phase} on rank {os.environ.get('RANK', 'caller')}", flush=True)
    if means == "raise":
        raise InjectedFault(f"injected fault in {phase} on rank {fault['rank']}")
    if means == "exit":
        os._exit(3)
    if means == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(10)
    if means == "segv":
        ctypes.string_at(0)  # a real segfault: faulthandler prints the stack, then SIGSEGV
    if means == "hang":
        if fault.get("ignore_sigterm"):
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        while True:
            time.sleep(0.05)
    raise ValueError(f"unknown means {means!r}")


def maybe_fault(fault: dict | None, phase: str) -> None:
    if fault and fault.get("phase") == phase and _fault_here(fault):
        inject_fault(fault)


def _identity(value):
    return value


def _rebuild_or_fault(fault: dict, value):
    maybe_fault(fault, fault["phase"])
    return value


class FaultOnUnpickle:
    """Pickles anywhere; unpickling it fires ``fault`` where the fault says (else: ``value``)."""

    def __init__(self, fault: dict, value=None) -> None:
        self.fault, self.value = fault, value

    def __reduce__(self):
        return (_rebuild_or_fault, (self.fault, self.value))


class FaultOnPickle:
    """Pickling it fires ``fault`` where the fault says; elsewhere it pickles as ``value``."""

    def __init__(self, fault: dict, value=None) -> None:
        self.fault, self.value = fault, value

    def __reduce__(self):
        maybe_fault(self.fault, self.fault["phase"])
        return (_identity, (self.value,))


class FaultWorker(DistributedWorker):
    """Fails at the phase its ``fault`` load_kwarg names, on the rank it names.

    load / reset / shutdown faults come from load_kwargs; shutdown fires in
    ``__del__``, which runs when the rank drops its worker on the way out.  A
    generate input ``{"fault": {...}, "value": v}`` fires in generate(); an input
    ``{"result": "pickle" | "unpickle", "on_rank": r, "fault": {...}, "value": v}``
    makes rank ``r`` return ``v`` wrapped so that pickling it (on the rank) or
    unpickling it (in the caller: fault rank "caller") fires; the other ranks return ``v``.
    Anything else is echoed.
    """

    fault: dict | None = None

    def load(self, fault: dict | None = None) -> None:
        self.fault = fault
        maybe_fault(fault, "load")

    def generate(self, input, /):
        if not isinstance(input, dict) or "fault" not in input:
            return input
        fault, value = input["fault"], input.get("value")
        wrap = input.get("result")
        if wrap is None:
            maybe_fault(fault, fault["phase"])
            return value
        if input.get("on_rank", fault["rank"]) != self.rank:
            return value  # only the chosen rank returns the booby-trapped result
        if wrap == "pickle":
            return FaultOnPickle(fault, value)
        return {"value": value, "trap": FaultOnUnpickle(fault)}

    def reset(self) -> None:
        maybe_fault(self.fault, "reset")

    def __del__(self) -> None:
        maybe_fault(self.fault, "shutdown")


def run_launcher_with_group_fault() -> None:
    """A ``launch_prefix`` entry point: runs the rank's serve loop in this process, with
    the fault in $REACTOR_TEST_FAULT (JSON) fired as the rank starts to form the
    torch.distributed group (worker code has not even been imported at that point)."""
    import json

    from reactor_dist.rank import group, server

    fault = json.loads(os.environ["REACTOR_TEST_FAULT"])
    form_group = group.Rendezvous.form_group

    def faulty_form_group(self, device, port):
        maybe_fault(fault, "group")
        return form_group(self, device, port)

    group.Rendezvous.form_group = faulty_form_group
    sys.exit(server.main([]))


class TorchrunStyleWorker(DistributedWorker):
    """Forms its own group from the torchrun environment (init_process_group=False)."""

    def load(self) -> None:
        import torch.distributed as dist

        dist.init_process_group("gloo")  # env:// rendezvous: MASTER_ADDR / MASTER_PORT
        self.dist = dist

    def generate(self, x, /):
        import torch

        t = torch.tensor([float(x) * (int(os.environ["RANK"]) + 1)])
        self.dist.all_reduce(t)
        return float(t)

    def reset(self) -> None:
        pass


@dataclasses.dataclass
class MetaTensor(Step):
    """Returns a tensor on the ``meta`` device (no data: it cannot reach the CPU)."""

    def run(self, worker: Echo):
        import torch

        return {"t": torch.empty(3, device="meta")}
