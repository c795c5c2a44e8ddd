"""Page-locking shared memory on a CUDA rank (``cudaHostRegister``).

A device-to-host copy into memory the driver does not know is page-locked goes through
its own staging buffer: about a third of the bandwidth of a copy into registered memory
(H200: 14-16 GB/s against 52-55 GB/s), and so does a host-to-device copy from it.  So a
CUDA rank registers each pooled result segment once, when it first hands it out
(``shared_empty``, or a device tensor staged by :mod:`reactor_dist.rank.staging`), and the
read-only mappings its inputs are copied to the GPU from; each is unregistered before
it is unmapped (retired, or closed).  A CPU rank never imports torch nor initialises
CUDA for this: the decision is :func:`reactor_dist.device.cuda_to_wait_for`'s.

Registered memory is locked in RAM: the registered bytes of a rank stay under its
``limit`` (``DistributedRunner(pinned_limit=...)``, :data:`PINNED_LIMIT` by default);
a segment beyond it stays plain memory.  A registration that fails (a driver limit,
memory it refuses) is logged once and turns that kind of registering off for this
process: the segments stay plain memory, slower, never an error.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from typing import Any

from ..device import cuda_to_wait_for
from ..wire.protocol import PINNED_LIMIT

log = logging.getLogger("reactor_dist")
REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context
REGISTER_READ_ONLY = 8  # cudaHostRegisterReadOnly: the device only reads it (a PROT_READ map)


def cuda_runtime_of(device: Callable[[], str]) -> Callable[[], Any]:
    """A finder of ``torch.cuda.cudart()`` for the rank whose device ``device()`` names:
    None on a CPU rank, and on a CUDA rank until its process initialised CUDA."""

    def find() -> Any:
        cuda = cuda_to_wait_for(device())
        return cuda.cudart() if cuda is not None else None

    return find


class HostPinning:
    """Which segments are registered with CUDA; each registered once, unregistered
    before it is unmapped.  ``cudart()`` gives the CUDA runtime bindings or None;
    ``limit`` bounds the registered bytes."""

    def __init__(self, cudart: Callable[[], Any], limit: int = PINNED_LIMIT) -> None:
        self._find = cudart
        self._cudart: Any = None
        self.limit = limit
        self.registered: dict[str, tuple[int, int]] = {}  # name -> (address, size)
        self.registered_bytes = 0
        self.off: set[bool] = set()  # read_only values whose registration failed once

    def pin(self, seg: Any, read_only: bool = False) -> bool:
        """Register ``seg`` (a name, an address, a size) unless it is already, it would
        pass the limit, or this is no CUDA rank (yet); whether it is registered now."""
        if seg.name in self.registered:
            return True
        if read_only in self.off or not seg.size or \
                self.registered_bytes + seg.size > self.limit:
            return False
        cudart = self._find()
        if cudart is None:
            return False
        flags = REGISTER_PORTABLE | (REGISTER_READ_ONLY if read_only else 0)
        code = int(cudart.cudaHostRegister(seg.address, seg.size, flags))
        if code != 0:
            self.off.add(read_only)
            clear_last_error(cudart)
            log.warning("reactor_dist: cudaHostRegister of a %d-byte shared-memory %s "
                        "failed (cudaError %d); %s use plain memory from now on (slower)",
                        seg.size, "input mapping" if read_only else "segment", code,
                        "copies of inputs to the GPU" if read_only else
                        "device-to-host copies into result segments")
            return False
        self._cudart = cudart
        self.registered[seg.name] = (seg.address, seg.size)
        self.registered_bytes += seg.size
        return True

    def unpin(self, seg: Any) -> None:
        """Unregister ``seg`` if it was registered; called before it is unmapped."""
        address, size = self.registered.pop(seg.name, (None, 0))
        if address is None:
            return
        self.registered_bytes -= size
        code = int(self._cudart.cudaHostUnregister(address))
        if code != 0:
            clear_last_error(self._cudart)
            log.debug("reactor_dist: cudaHostUnregister of %s failed (cudaError %d)",
                      seg.name, code)

    def is_pinned(self, name: str) -> bool:
        return name in self.registered


def clear_last_error(cudart: Any) -> None:
    """Reset CUDA's last error after a failure we handled, so that torch's next kernel
    launch check does not report it.  torch's bindings lack cudaGetLastError: the
    libcudart torch loaded is asked directly; a stand-in may offer its own."""
    own = getattr(cudart, "cudaGetLastError", None)
    if own is not None:
        own()
        return
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart" in line}
        for path in sorted(paths):
            ctypes.CDLL(path).cudaGetLastError()
    except (OSError, AttributeError):
        pass  # nothing loaded to ask (a static build): the next CUDA check may report it
