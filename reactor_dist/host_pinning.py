"""Page-locking rank 0's result segments on a CUDA rank (``cudaHostRegister``).

A device-to-host copy into memory the driver does not know is page-locked goes through
its own staging buffer: about a third of the bandwidth of a copy into registered memory
(H200: 14-16 GB/s against 52-55 GB/s).  So a CUDA rank registers each pooled result
segment once, when ``shared_empty`` first hands it out, and unregisters it before the
ledger unmaps it (retired, or closed).  A CPU rank never imports torch nor initialises
CUDA for this: the decision is :func:`reactor_dist.device.cuda_to_wait_for`'s.

A registration that fails (a driver limit, memory it refuses) is logged once and turns
registering off for this process: the segments stay plain memory, slower, never an error.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from typing import Any

from .device import cuda_to_wait_for
from .shm import Segment

log = logging.getLogger("reactor_dist")
REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context


def cuda_runtime_of(device: Callable[[], str]) -> Callable[[], Any]:
    """A finder of ``torch.cuda.cudart()`` for the rank whose device ``device()`` names:
    None on a CPU rank, and on a CUDA rank until its process initialised CUDA."""

    def find() -> Any:
        cuda = cuda_to_wait_for(device())
        return cuda.cudart() if cuda is not None else None

    return find


class HostPinning:
    """Which segments are registered with CUDA; each registered once, unregistered
    before it is unmapped.  ``cudart()`` gives the CUDA runtime bindings or None."""

    def __init__(self, cudart: Callable[[], Any]) -> None:
        self._find = cudart
        self._cudart: Any = None
        self.registered: dict[str, int] = {}  # segment name -> its registered address
        self.off = False  # a registration failed: plain memory from now on

    def pin(self, seg: Segment) -> None:
        """Register ``seg`` unless it is already, or this is no CUDA rank (yet)."""
        if self.off or seg.name in self.registered or not seg.size:
            return
        cudart = self._find()
        if cudart is None:
            return
        code = int(cudart.cudaHostRegister(seg.address, seg.size, REGISTER_PORTABLE))
        if code != 0:
            self.off = True
            clear_last_error(cudart)
            log.warning("reactor_dist: cudaHostRegister of a %d-byte shared-memory segment "
                        "failed (cudaError %d); device-to-host copies into shared_empty "
                        "buffers use plain memory from now on (slower)", seg.size, code)
            return
        self._cudart = cudart
        self.registered[seg.name] = seg.address

    def unpin(self, seg: Segment) -> None:
        """Unregister ``seg`` if it was registered; called before it is unmapped."""
        address = self.registered.pop(seg.name, None)
        if address is None:
            return
        code = int(self._cudart.cudaHostUnregister(address))
        if code != 0:
            clear_last_error(self._cudart)
            log.debug("reactor_dist: cudaHostUnregister of %s failed (cudaError %d)",
                      seg.name, code)


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
