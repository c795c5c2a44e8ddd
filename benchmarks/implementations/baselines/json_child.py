"""One rank of the JSON/stdin-stdout baseline: read a JSON line, run the step, answer
with a JSON line; arrays travel as ``.npy`` files named in the messages."""

from __future__ import annotations

import json
import os
import sys
import traceback

import numpy as np

from benchmarks.implementations.workload import BenchModel


def _decode(req: dict) -> object:
    op = req["op"]
    if op == "none":
        return None
    if op == "int":
        return int(req["arg"])
    if op == "array":
        return np.load(req["path"])
    if op == "echo":
        return ("echo", np.load(req["path"]))
    return (op, tuple(req["arg"]) if isinstance(req["arg"], list) else req["arg"])


def main() -> None:
    rank, result_shapes, out_dir = int(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
    model = BenchModel(rank, [tuple(s) for s in result_shapes])
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    stdout.write(b'{"ready": true}\n')
    stdout.flush()
    seq = 0
    for line in stdin:
        req = json.loads(line)
        if req["op"] == "exit":
            break
        seq += 1
        try:
            out = model.step(_decode(req))
            reply: dict = {"ok": True, "path": None}
            if type(out) is int:
                reply["value"] = out
            elif isinstance(out, np.ndarray):
                path = os.path.join(out_dir, f"out-{rank}-{seq}.npy")
                np.save(path, out)
                reply["path"] = path
        except Exception as exc:  # the parent re-raises it
            reply = {"ok": False, "error": repr(exc), "traceback": traceback.format_exc()}
        stdout.write(json.dumps(reply).encode() + b"\n")
        stdout.flush()


if __name__ == "__main__":
    main()
