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

Backends: torch's ``"nccl"`` serves CUDA tensors only (read in 2.13; the GPU check ran
it on 2.11), and a model's CPU-side collectives (the Quickstart's all_gather of CPU
tensors) would raise "No backend type associated with device type cpu".  A CUDA rank's
group therefore has a backend per device (:data:`CUDA_BACKENDS`), and is bound to the
rank's GPU (``device_id=``): NCCL then forms its communicator inside
``init_process_group``, during ``start()`` and under ``start_timeout`` (and "torch group
formed in X s" measures it), not lazily at the first collective inside ``load()`` or a
call.

Getting out of a failed step: when a rank dies or stops answering, a survivor may wait
in a collective for it, or for another survivor that waits in a different one; gloo
would hold them there until the group's timeout.  At a restart the runner sends every
survivor :data:`~reactor_dist.wire.protocol.GROUP_ABORT_SIGNAL`; a thread of the rank that
waits for nothing else (:func:`watch_abort`) then aborts a CUDA group's NCCL
communicators and shuts down the TCP connections the group opened (``Rendezvous.abort``:
gloo's own ``abort()`` leaves a waiting collective where it is).  Every collective in
flight then raises ("Connection closed by peer"), on this rank and on each peer it was
connected to, the call fails as it already had, and the rank answers the restart's
PING and keeps its model.  Subgroups a model forms itself (``new_group``) are its own.

NCCL first: its bootstrap and proxy sockets are among the group's (``device_id=``
connects them inside ``init_process_group``), and ``ncclCommAbort`` needs them; the
sockets are held (dup) across it, so that a number NCCL frees is never another socket's
when they are shut down.  An abort takes NCCL from a tenth of a second to seconds (gloo
none), and two can be asked at once (the signal, and the REJOIN's ``leave_group``): it
runs once per group, under ``Rendezvous.lock``, and a second ask waits for the first and
then finds it done.  A signal the abort thread woke for is for the group of that moment
(``Rendezvous.group``): one that comes to it after the group was left and a new one
formed does nothing.  ``TORCH_NCCL_ASYNC_ERROR_HANDLING=0`` (placement/rank_env.py)
keeps NCCL's watchdog from ending the process first.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ..wire.protocol import GROUP_ABORT_SIGNAL, RANK_SIGNALS, Bootstrap, store_file

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


def block_rank_signals() -> None:
    """At a rank's start, before any thread exists (threads inherit it): the abort and
    recorder signals are blocked everywhere, so that only the ``sigwait`` of
    :func:`watch_abort` and of flight_recorder.answer take them (their default action
    would end the rank)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, set(RANK_SIGNALS))


def watch_abort(rendezvous: Rendezvous) -> None:
    """A thread that aborts the rank's group at each abort signal."""
    def wait() -> None:
        while True:
            signal.sigwait({GROUP_ABORT_SIGNAL})
            rendezvous.abort(rendezvous.group)  # the group of now, whenever it gets the lock

    threading.Thread(target=wait, name="reactor-dist-group-abort", daemon=True).start()


def socket_fds() -> set[int]:
    """This process's open sockets (their descriptors)."""
    found = set()
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                found.add(int(name))
    return found


def connections(fds: set[int]) -> list[socket.socket]:
    """A hold (a dup) on each connected TCP socket of ``fds``; listeners are left out:
    gloo ends the process when its listener fails."""
    held = []
    for fd in sorted(fds):
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue  # closed meanwhile
        try:
            if sock.family in (socket.AF_INET, socket.AF_INET6) and \
                    not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                held.append(sock)
                continue
        except OSError:
            pass
        sock.close()
    return held


def shut_down(held: list[socket.socket]) -> None:
    """Shut down (both ways) and let go of each socket of ``held``."""
    for sock in held:
        with sock, contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


def abort_nccl() -> None:
    """Abort every NCCL communicator of the rank's group (torch's own call, which also
    forgets the group); nothing where torch has no such call or no group is left."""
    import torch.distributed as dist

    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is not None and dist.is_initialized():
        with contextlib.suppress(Exception):
            abort()


class Rendezvous:
    """One rank's side of the group's store."""

    def __init__(self, boot: Bootstrap, private_dir: str) -> None:
        self.boot, self.private_dir = boot, private_dir
        self.store: Any = None
        self.device = "cpu"  # the group's, once formed
        # The sockets the group opened (its gloo pairs; across nodes, the store's
        # client): what abort() shuts down.  Guarded: the abort thread reads them.
        self.lock = threading.Lock()
        self.group_fds: set[int] = set()
        self.formed = 0  # groups formed so far
        self.group = 0  # the number of the group of now (0: none)
        self.aborted = 0  # the last group aborted (its number; 0: none)
        self.aborts = 0  # aborts carried out (one per group at most)
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
            self.store = dist.FileStore(os.path.join(self.private_dir, store_file(self.epoch)),
                                        boot.world_size)
            self.store.set_timeout(self.timeout)
        before = socket_fds()
        dist.init_process_group(store=self.store, rank=boot.rank, world_size=boot.world_size,
                                timeout=self.timeout, **group_options(device))
        with self.lock:
            self.device, self.group_fds = device, socket_fds() - before
            self.formed += 1
            self.group = self.formed

    def abort(self, group: int) -> None:
        """Every collective of group number ``group`` in flight raises now, here and on
        the peers (see the module's docstring); the group stays to be left.  Once per
        group: a second ask waits for the first, then finds it done; an ask for a group
        already left does nothing."""
        with self.lock:
            self._abort(group)

    def _abort(self, group: int) -> None:  # under self.lock
        if not group or group != self.group or group == self.aborted:
            return
        self.aborted = group
        held = connections(self.group_fds)
        try:
            if self.device.startswith("cuda"):
                abort_nccl()
        finally:
            shut_down(held)
        self.aborts += 1

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
        aborted: NCCL's destroy may wait for a peer that is gone), and its store.  The
        restart's abort signal, sent before the REJOIN that brought us here, is taken
        here if the abort thread has not taken it yet: the abort then runs once, in
        this thread, and a late wake of that thread finds the group gone."""
        import torch.distributed as dist

        with self.lock:
            signal.sigtimedwait({GROUP_ABORT_SIGNAL}, 0)  # the restart's, if still pending
            self._abort(self.group)  # peers may wait on us in the failed step
            if not device.startswith("cuda") and dist.is_initialized():
                dist.destroy_process_group()  # (NCCL's abort forgot a CUDA group already;
                #                                 its destroy could wait for a peer gone)
            self.group_fds = set()  # closed: their numbers may be reused
            self.group = 0  # an abort asked for the old group does nothing
        self.store = None

    def serve_calls(self) -> None:
        """``load()`` is done: the group's collectives now wait at most
        ``Bootstrap.group_timeout`` (torch sets it on each backend of the group: read in
        2.13's source)."""
        from torch.distributed import distributed_c10d

        distributed_c10d._set_pg_timeout(timedelta(seconds=self.boot.group_timeout))
