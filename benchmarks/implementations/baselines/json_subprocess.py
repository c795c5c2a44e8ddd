"""Baseline (a): a subprocess per rank driven by JSON lines over its stdin/stdout, with
input and result arrays written to temporary ``.npy`` files (the usual adapter)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

from benchmarks.implementations.procs import ClosesOnExit, child_env, stop_processes


class JsonSubprocessPool(ClosesOnExit):
    name = "json-subprocess"
    supports_shared = False

    def __init__(self, world_size: int, result_shapes: list[tuple[int, ...]]) -> None:
        self.world_size = world_size
        self.tmp = tempfile.mkdtemp(prefix=f"rdbench-{os.getpid()}-json-")
        self._seq = 0
        self.procs: list[subprocess.Popen[bytes]] = []
        try:
            for rank in range(world_size):
                self.procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "benchmarks.implementations.baselines.json_child",
                         str(rank), json.dumps([list(s) for s in result_shapes]), self.tmp],
                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=child_env(),
                    )
                )
            for p in self.procs:
                self._read(p)
        except BaseException:
            self.close()
            raise

    def _read(self, proc: subprocess.Popen[bytes]) -> dict:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"json-subprocess rank exited with {proc.wait()}")
        return json.loads(line)

    def generate(self, inp: object) -> object:
        self._seq += 1
        in_path = None
        if inp is None:
            req: dict = {"op": "none"}
        elif type(inp) is int:
            req = {"op": "int", "arg": inp}
        elif isinstance(inp, np.ndarray):
            in_path = os.path.join(self.tmp, f"in-{self._seq}.npy")
            np.save(in_path, inp)
            req = {"op": "array", "path": in_path}
        elif isinstance(inp, tuple) and inp[0] == "echo":
            in_path = os.path.join(self.tmp, f"in-{self._seq}.npy")
            np.save(in_path, inp[1])
            req = {"op": "echo", "path": in_path}
        else:
            op, arg = inp  # type: ignore[misc]
            req = {"op": op, "arg": list(arg) if isinstance(arg, tuple) else arg}
        line = json.dumps(req).encode() + b"\n"
        try:
            for p in self.procs:
                assert p.stdin is not None
                p.stdin.write(line)
                p.stdin.flush()
            replies = [self._read(p) for p in self.procs]
        finally:
            if in_path is not None:
                os.unlink(in_path)
        for r in replies:
            if not r["ok"]:
                raise RuntimeError(f"rank failed: {r['error']}\n{r['traceback']}")
        path = replies[0]["path"]
        if path is None:
            return replies[0].get("value")
        try:
            return np.load(path)
        finally:
            os.unlink(path)

    def close(self) -> None:
        for p in self.procs:
            try:
                assert p.stdin is not None
                p.stdin.write(b'{"op": "exit"}\n')
                p.stdin.close()
            except (OSError, ValueError):
                pass
        stop_processes(self.procs)
        for p in self.procs:
            if p.stdout is not None:
                p.stdout.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

