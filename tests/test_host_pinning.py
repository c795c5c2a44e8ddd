"""Page-locking rank 0's result segments (host_pinning.py): which segments a rank
registers with CUDA, the register/unregister pairing over a segment's life in the
ledger, and the fallback when registering fails. A stand-in ``torch.cuda`` (with its
``cudart()``) is injected in a subprocess, the way test_timings checks the wait."""

from __future__ import annotations

import subprocess
import sys

PINNING = """
import logging, sys, tempfile, types
from reactor_dist.host_pinning import HostPinning, cuda_runtime_of
from reactor_dist.ledger import Ledger

logging.basicConfig(level=logging.DEBUG, format="LOG %(levelname)s %(message)s",
                    stream=sys.stdout)
calls = []

class Cudart:
    code = 0
    def cudaHostRegister(self, ptr, size, flags):
        calls.append(("register", ptr, size, flags)); return self.code
    def cudaHostUnregister(self, ptr):
        calls.append(("unregister", ptr, seg_open(ptr))); return 0
    def cudaGetLastError(self):
        calls.append(("cleared",))

def seg_open(ptr):
    return any(s.address == ptr and not s.mm.closed for s in seen)  # still mapped?

seen = []

def run(device):
    pinning = HostPinning(cuda_runtime_of(lambda: device))
    ledger = Ledger(tempfile.gettempdir(), "rdpin", "t-", keep_free=0,
                    before_close=pinning.unpin)
    a = ledger.acquire(1 << 20, "a", ["w"]); pinning.pin(a)
    b = ledger.acquire(2 << 20, "b", ["w"]); pinning.pin(b)
    seen[:] = [a, b]
    ledger.release(a.name, "w"); assert ledger.retire_idle() == [a.name]
    ledger.release(b.name, "w")
    b2 = ledger.acquire(1 << 20, "b again", ["w"])
    pinning.pin(b2) if b2 is b else print("b not reused")
    ledger.close()
    return a, b

run("cpu"); run("cuda:0")  # torch never imported: nothing registered
print("torch" in sys.modules, calls)
state = types.SimpleNamespace(is_initialized=lambda: True, cudart=Cudart)
sys.modules["torch.cuda"] = state  # CUDA initialised in this process
run("cpu"); print(calls)
a, b = run("cuda:1")
print(calls == [("register", a.address, a.size, 1), ("register", b.address, b.size, 1),
                ("unregister", a.address, True), ("unregister", b.address, True)])
calls.clear(); Cudart.code = 712  # cudaErrorHostMemoryAlreadyRegistered, say
a, b = run("cuda:1")
print(calls == [("register", a.address, a.size, 1), ("cleared",)])
"""


def test_only_a_cuda_rank_with_cuda_initialised_registers_each_segment_once():
    out = subprocess.run([sys.executable, "-c", PINNING], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    logs = [line for line in lines if line.startswith("LOG ")]
    assert [line for line in lines if not line.startswith("LOG ")] == [
        "False []", "[]", "True", "True"]
    assert len(logs) == 1 and logs[0].startswith(
        "LOG WARNING reactor_dist: cudaHostRegister of a 1048576-byte shared-memory "
        "segment failed (cudaError 712)")
