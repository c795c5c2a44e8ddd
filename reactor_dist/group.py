"""Where a rank meets its torch group: torch.distributed with gloo on CPU; on CUDA, gloo
for CPU tensors and nccl for CUDA tensors.

On one machine the store is a file in the runner's private 0700 directory: only the
runner's user can reach it.  Across machines (ranks placed by Ray) it is rank 0's
TCPStore on rank 0's node address (``Bootstrap.master_addr``), listening on that
address alone; rank 0 reports its port in its PONG and the runner passes it on in
Kind.INIT.

Timeouts: the store and the group are formed under ``start_timeout``, which also bounds
the collectives of ``load()`` (rank 0 may download weights while the others wait in a
broadcast).  Once ``load()`` is done the group's own timeout becomes
``Bootstrap.group_timeout`` (``call_timeout`` plus a margin, see
:func:`reactor_dist.timeouts.for_group`): a collective that waits longer than that
is aborted by torch, so a rank that raised before a collective does not leave the others
spinning for an hour.

Backends: torch 2.13's ``"nccl"`` serves CUDA tensors only, and a model's CPU-side
collectives (the Quickstart's all_gather of CPU tensors) would raise "No backend
type associated with device type cpu".  A CUDA rank's group therefore has a backend per
device (:data:`CUDA_BACKENDS`), and is bound to the rank's GPU (``device_id=``): NCCL
then forms its communicator inside ``init_process_group``, during ``start()`` and under
``start_timeout`` (and "torch group formed in X s" measures it), not lazily at the first
collective inside ``load()`` or a call.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from .protocol import Bootstrap

CPU_BACKEND = "gloo"
CUDA_BACKENDS = "cpu:gloo,cuda:nccl"  # CPU tensors through gloo, CUDA tensors through NCCL


def group_options(device: str) -> dict[str, Any]:
    """The keyword arguments of ``init_process_group`` that depend on the rank's device
    (``device``: "cpu" or "cuda:<index>", as :func:`reactor_dist.device.choose_device`
    gives it)."""
    if not device.startswith("cuda"):
        return {"backend": CPU_BACKEND}
    import torch

    return {"backend": CUDA_BACKENDS, "device_id": torch.device(device)}


class Rendezvous:
    """One rank's side of the group's store."""

    def __init__(self, boot: Bootstrap, private_dir: str) -> None:
        self.boot, self.private_dir = boot, private_dir
        self.store: Any = None
        self.epoch = 0  # the group's generation (restart(): +1)
        self.timeout = timedelta(seconds=boot.start_timeout)

    def open(self) -> int:
        """Rank 0 of a group across nodes opens its store now: the port to report."""
        if not self.boot.master_addr or self.boot.rank != 0:
            return 0
        import torch.distributed as dist

        listener = socket.create_server((self.boot.master_addr, 0), backlog=128)
        port = listener.getsockname()[1]
        self.store = dist.TCPStore(self.boot.master_addr, port, self.boot.world_size, True,
                                   timeout=self.timeout, wait_for_workers=False,
                                   master_listen_fd=listener.detach())
        return port

    def form_group(self, device: str, port: int) -> None:
        """Join the group of generation ``self.epoch`` (0 at start, +1 per restart: each
        has a store of its own)."""
        import torch.distributed as dist

        boot = self.boot
        if self.store is None and boot.master_addr:
            self.store = dist.TCPStore(boot.master_addr, port, boot.world_size, False,
                                       timeout=self.timeout)
        elif self.store is None:
            name = "store" if not self.epoch else f"store.{self.epoch}"
            self.store = dist.FileStore(os.path.join(self.private_dir, name),
                                        boot.world_size)
            self.store.set_timeout(self.timeout)
        dist.init_process_group(store=self.store, rank=boot.rank, world_size=boot.world_size,
                                timeout=self.timeout, **group_options(device))

    def rejoin(self, device: str, epoch: int, port: int, ack: Callable[[int], None]) -> float:
        """restart(), on a rank that keeps its model: leave the old group, ``ack`` (with
        rank 0's new store port across nodes, else 0), join the group of ``epoch``
        (``port``: rank 0's store, from the runner); the seconds the joining took."""
        self.leave_group(device)
        own = self.open()
        ack(own)
        began = time.perf_counter()
        self.epoch = epoch
        self.form_group(device, port or own)
        self.serve_calls()
        return time.perf_counter() - began

    def leave_group(self, device: str) -> None:
        """restart(), on a rank that keeps its model: the old group goes (a CUDA group is
        aborted: NCCL's destroy may wait for a peer that is gone), and its store."""
        import torch.distributed as dist

        if dist.is_initialized():
            abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
            if device.startswith("cuda") and abort is not None:
                abort()
            else:
                dist.destroy_process_group()
        self.store = None

    def serve_calls(self) -> None:
        """``load()`` is done: the group's collectives now wait at most
        ``Bootstrap.group_timeout`` (torch 2.13 sets it on each backend of the group)."""
        from torch.distributed import distributed_c10d

        distributed_c10d._set_pg_timeout(timedelta(seconds=self.boot.group_timeout))
