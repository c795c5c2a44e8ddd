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

from reactor_dist import DistributedWorker


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
                   "NeedsTwoArgs": NeedsTwoArgs}[name]
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
