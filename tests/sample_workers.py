"""Workers the tests drive: each ``generate`` input is a small script of what to do.

A script is a dict ``{"op": ..., "ranks": [...] or None (all), ...}``; ranks not
named by ``ranks`` just echo.  Every rank appends what it ran to
``<log_dir>/rank<N>.log`` when ``log_dir`` is given, so tests can compare ranks.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

import numpy as np

from reactor_dist import DistributedWorker, SharedSlotAllocationFailed


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


class ScriptedWorker(DistributedWorker):
    def load(self, log_dir: str | None = None, fail_load_on: list[int] | None = None,
             hang_load_on: list[int] | None = None, print_on_load: str | None = None) -> None:
        self.log_dir = log_dir
        self.children: list[subprocess.Popen] = []
        if print_on_load:
            print(f"{print_on_load} from rank {self.rank}", flush=True)
        if fail_load_on and self.rank in fail_load_on:
            raise FileNotFoundError(f"weights missing on rank {self.rank}")
        if hang_load_on and self.rank in hang_load_on:
            time.sleep(3600)

    def log(self, text: str) -> None:
        if self.log_dir:
            with open(os.path.join(self.log_dir, f"rank{self.rank}.log"), "a") as f:
                f.write(text + "\n")

    def generate(self, script, /):
        if not isinstance(script, dict) or "op" not in script:
            self.log(f"echo {script!r}"[:200])
            return script
        op = script["op"]
        self.log(f"{op} {script.get('tag', '')}")
        targets = script.get("ranks")
        if targets is not None and self.rank not in targets:
            return script.get("value")
        if op == "raise":
            types = script.get("types", {})
            name = types.get(self.rank, types.get(str(self.rank), script.get("type", "ValueError")))
            cls = {"ValueError": ValueError, "KeyError": KeyError, "ZeroDivisionError":
                   ZeroDivisionError, "Unpicklable": Unpicklable,
                   "NeedsTwoArgs": NeedsTwoArgs,
                   "SharedSlotAllocationFailed": SharedSlotAllocationFailed}[name]
            if cls is NeedsTwoArgs:
                raise NeedsTwoArgs("left", "right")
            raise cls(f"boom on rank {self.rank}")
        if op == "exit":
            print(f"rank {self.rank} about to exit", flush=True)
            sys.stderr.write(f"last words of rank {self.rank}\n")
            sys.stderr.flush()
            os._exit(script.get("code", 3))
        if op == "signal":
            print(f"rank {self.rank} about to be signalled", flush=True)
            os.kill(os.getpid(), script.get("sig", signal.SIGKILL))
            time.sleep(10)
        if op == "segv":
            ctypes.string_at(0)
        if op == "raise_or_hang":
            if self.rank == 0:
                raise ValueError("rank 0 gave up")
            op = "hang"
        if op == "hang":
            while True:
                time.sleep(0.05)
        if op == "sleep":
            time.sleep(script["seconds"])
            return script.get("value")
        if op == "env":
            keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                    "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "EXTRA", "PREFIXED")
            return {"rank": self.rank, "device": self.device,
                    "env": {k: os.environ.get(k) for k in keys}}
        if op == "spawn_child":
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
            self.children.append(child)
            return child.pid
        if op == "allgather":
            import torch
            import torch.distributed as dist

            mine = torch.full((2,), float(self.rank + 1))
            parts = [torch.zeros(2) for _ in range(self.world_size)]
            dist.all_gather(parts, mine)
            return torch.cat(parts).numpy()
        if op == "unpicklable_result":
            return lambda: None
        if op == "bad_result":
            return BadSetState()
        if op == "shared":
            out = self.shared_empty(script["shape"], script.get("dtype", "uint8"))
            out[...] = script.get("fill", 7)
            return out
        if op == "array":
            return np.full(script["shape"], script.get("fill", 1), dtype=script.get("dtype", "u1"))
        if op == "write_input":
            # Rank 1.. write at once; rank 0 looks a little later: it must not see their writes.
            array = script["value"]
            if self.rank != 0:
                array[...] = self.rank + 100
                return None
            time.sleep(script.get("delay", 0.3))
            seen = array.copy()
            array[...] = 100
            return seen
        raise ValueError(f"unknown op {op!r}")

    def reset(self) -> None:
        self.log("reset")


class NoMethods:
    pass


class OnlyLoad:
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

    from reactor_dist import rank

    fault = json.loads(os.environ["REACTOR_TEST_FAULT"])
    form_group = rank.RankServer.form_group

    def faulty_form_group(self, device, port):
        maybe_fault(fault, "group")
        return form_group(self, device, port)

    rank.RankServer.form_group = faulty_form_group
    sys.exit(rank.main([]))


class ChildSpawningWorker(ScriptedWorker):
    """ScriptedWorker plus ``{"op": "spawn_detached"}``: a child that leaves the rank's
    process group (its own session), so that killing the group alone would miss it."""

    def generate(self, script, /):
        if isinstance(script, dict) and script.get("op") == "spawn_detached":
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                                     start_new_session=True)
            self.children.append(child)
            return child.pid
        return super().generate(script)


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
