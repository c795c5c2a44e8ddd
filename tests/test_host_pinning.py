"""Page-locking shared memory (host_pinning.py): which segments a rank registers with
CUDA, the register/unregister pairing over a segment's life in the ledger, the fallback
when registering fails, the limit on registered bytes, warm segments kept and taken
first, and the read-only registration of an input's mapping (staging.py). A stand-in
``torch.cuda`` (with its ``cudart()``) is injected in a subprocess, the way test_timings
checks the wait."""

from __future__ import annotations

import subprocess
import sys

PINNING = """
import logging, sys, tempfile, types
from reactor_dist.rank.host_pinning import HostPinning, cuda_runtime_of
from reactor_dist.shm.ledger import Ledger

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


WARM = """
import os, sys, tempfile
import numpy as np
from reactor_dist.rank.host_pinning import HostPinning
from reactor_dist.shm.ledger import Ledger
from reactor_dist.shm.segments import PrivateView, Segment
from reactor_dist.rank.staging import InputStaging

MiB = 1 << 20
calls, mapped = [], {}

class Cudart:
    def cudaHostRegister(self, ptr, size, flags):
        calls.append(("register", size, flags)); return 0
    def cudaHostUnregister(self, ptr):
        calls.append(("unregister", mapped.get(ptr, lambda: "unknown")())); return 0

def still_mapped(seg):
    mapped[seg.address] = lambda: "mapped" if not seg.mm.closed else "unmapped"

# The limit: registered bytes stay under it; unregistering makes room again.
pinning = HostPinning(Cudart, limit=3 * MiB)
d = tempfile.mkdtemp()
ledger = Ledger(d, "rdwarm", "t-", keep_free=1, before_close=pinning.unpin,
                warm=pinning.is_pinned)
small = ledger.acquire(MiB, "small", ["w"])             # 1 MiB, stays plain
big = ledger.acquire(2 * MiB, "big", ["w"]); print(pinning.pin(big))
other = ledger.acquire(2 * MiB, "other", ["w"]); print(pinning.pin(other))  # over the limit
for seg in (small, big, other):
    still_mapped(seg)
print(pinning.registered_bytes == 2 * MiB, calls == [("register", 2 * MiB, 1)])
ledger.release(other.name, "w"); ledger.retire_idle()   # other retired, never registered
ledger.release(small.name, "w"); ledger.release(big.name, "w")
# A warm segment is taken before a smaller plain one that fits too.
print(ledger.acquire(MiB, "again", ["w"]) is big)
ledger.release(big.name, "w")
# The idle trim keeps the warm one a steady stream needs, retires the plain one.
print(ledger.has_idle(keep_warm=True), ledger.retire_idle(keep_warm=True) == [small.name],
      ledger.has_idle(keep_warm=True), list(ledger.idle) == [big.name])
# A peer's reclaim retires every idle segment, warm ones too: unregistered while mapped.
print(ledger.retire_idle() == [big.name], calls[-1] == ("unregister", "mapped"),
      pinning.registered_bytes)
ledger.close()

# An input's registered mapping: read-only, registered once, unregistered before unmapping.
calls.clear()
seg = Segment.create(d, "rdwarm.in-x", 4 * MiB, "input")
np.frombuffer(seg.mm, np.uint8)[:] = 7
view = PrivateView(d, seg.name)
staging = InputStaging(d, lambda: {seg.name: view}, HostPinning(Cudart), lambda: "cpu",
                       cpu_too=True)
x = np.frombuffer(view.buffer, np.uint8)[MiB:3 * MiB]
for _ in range(2):
    print(int(staging.to_device(x).sum()) == 7 * 2 * MiB)
dma = staging.dma[seg.name]
mapped[dma.address] = lambda: "mapped" if dma.address else "unmapped"
staging.unmapped(seg.name)
print(staging.fast, calls == [("register", 4 * MiB, 9), ("unregister", "mapped")])
view.close(); seg.close(unlink=True)

# Registration is tried again at each use: CUDA not up yet at the first (no runtime),
# the second registers the mapping, the third finds it registered.
calls.clear()
up = []
seg = Segment.create(d, "rdwarm.in-y", 4 * MiB, "input")
view = PrivateView(d, seg.name)
staging = InputStaging(d, lambda: {seg.name: view},
                       HostPinning(lambda: Cudart() if up else None), lambda: "cpu",
                       cpu_too=True)
x = np.frombuffer(view.buffer, np.uint8)[:MiB]
staging.to_device(x); print(calls == [], staging.fast)
up.append(True)
staging.to_device(x); staging.to_device(x)
print(calls == [("register", 4 * MiB, 9)], staging.fast)
staging.close(); view.close(); seg.close(unlink=True); os.rmdir(d)  # empty: all went
"""


def test_registered_segments_stay_warm_within_the_limit_and_inputs_register_read_only():
    out = subprocess.run([sys.executable, "-c", WARM], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "True", "False", "True True", "True", "True True False True", "True True 0",
        "True", "True", "2 True", "True 1", "True 3"]
