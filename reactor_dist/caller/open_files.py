"""File descriptors: does ``RLIMIT_NOFILE`` leave room for a runner of ``world_size``
ranks?

Running out inside libzmq raises nothing: its I/O thread aborts the whole process
(``Too many open files (src/ipc_listener.cpp:297)``) when it cannot accept a rank's
connection.  So :meth:`Supervisor.start <reactor_dist.caller.supervisor.Supervisor.start>`
checks first, before anything starts, and raises
:class:`~reactor_dist.errors.FileLimitTooLow` with the numbers and the fix.

What a runner holds in the caller's process, measured (Linux, pyzmq 27.3, libzmq
4.3.5): the smallest limit at which ``start()`` and a call with a 4 MiB input succeed
is the descriptors already open + 17 + 5 per rank (spawned ranks), at world_size 1, 2, 4 and 8, with
and without ``init_process_group``.

- :data:`FIXED` (19): ZeroMQ's context and the two sockets (2 epoll, 5 eventfd, 2
  listening sockets), the private directory's lock, the death watch's wake pipe and
  the releaser's (14 for the runner's life); the stdin and exec-error pipes of a
  rank being spawned, and the segments a call maps (3 more, for moments); the sockets
  of the rank templates the ranks are forked from (reactor_dist.placement.template: one for the
  ranks of a torch group, one for the others; 2, for the process's life).
- :data:`PER_RANK` (5): the rank's pidfd and the death watch's, its output pipe, its
  two connections (commands, replies).
- :data:`SEGMENTS` (32): each mapped /dev/shm segment holds a descriptor (Python's
  mmap keeps a duplicate): the warm segments of both pools (up to 16 each), the items
  a caller keeps.

The ranks inherit the limit; a rank with a real model (CUDA, NCCL) needs far more of
its own, which ``reactor-dist doctor`` checks (at least 1024).
"""

from __future__ import annotations

import os
import resource

from ..errors import FileLimitTooLow

FIXED, PER_RANK, SEGMENTS = 19, 5, 32


def needed(world_size: int) -> int:
    """Descriptors a runner of ``world_size`` ranks opens in the caller, with a margin."""
    return FIXED + PER_RANK * world_size + SEGMENTS


def in_use(limit: int) -> int:
    """Descriptors open now below ``limit`` (a new one takes the lowest free number)."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return 3  # no /proc: stdin, stdout and stderr at least
    return max(0, sum(1 for n in names if n.isdigit() and int(n) < limit) - 1)  # the listing's own


def room() -> tuple[int | None, int, int | None]:
    """(the soft limit, None when unlimited; descriptors in use; ranks that fit, None
    when unlimited)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return None, in_use(1 << 62), None
    used = in_use(soft)
    return soft, used, max(0, (soft - used - FIXED - SEGMENTS) // PER_RANK)


def check_room(world_size: int) -> None:
    """FileLimitTooLow unless the soft RLIMIT_NOFILE leaves room for ``world_size`` ranks."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return
    used, need = in_use(soft), needed(world_size)
    if used + need <= soft:
        return
    enough = used + need
    unlimited = hard == resource.RLIM_INFINITY
    suggest = max(enough, 4096 if unlimited else min(4096, hard))
    hard_note = "unlimited" if unlimited else str(hard)
    if not unlimited and hard < enough:
        hard_note += "; raising it past that needs root, or docker --ulimit nofile=65536"
    raise FileLimitTooLow(
        f"the open files limit (RLIMIT_NOFILE) is {soft}, with {used} descriptors in use: "
        f"a runner of {world_size} rank{'s' if world_size != 1 else ''} needs {need} more "
        f"({FIXED} + {PER_RANK} per rank + {SEGMENTS} for shared-memory segments), so at "
        f"least {enough} is needed. Raise it before starting: `ulimit -n {suggest}` in the "
        f"shell, or resource.setrlimit(resource.RLIMIT_NOFILE, ({suggest}, hard)) in Python "
        f"(the hard limit is {hard_note}); nothing was started")
