"""Shared-memory segments in /dev/shm: creation, mapping, private views, cleanup.

Which segment may be reused when is the ledger's business
(:mod:`reactor_dist.shm.ledger`); this module only makes, maps and removes them.

Names (:func:`reactor_dist.wire.protocol.segment_prefix`) carry the owner's pid and
start time, and each runner holds an flock on its ``<prefix>.lock`` entry for as
long as it lives, so any later runner on the machine recognises entries whose owner
is dead (its lock is free or gone, or its process is past its death; without a lock
file: pid gone or reused) and removes them, the lock too; a live runner's entries
are never touched, also where the owner's pid means nothing here (a runner in
another pid namespace).  Every entry is created 0600.
Removal touches only regular files owned by this user (lstat: a link is never
followed); anything else in /dev/shm, another user's file or a directory squatting
on a name, is left alone, and an error while removing is logged (logger
``reactor_dist``) and skipped, never raised.

Capacity: before creating a segment we check the filesystem can hold it, and we
reserve its pages with ``posix_fallocate`` so that a full /dev/shm is an ENOSPC
error at creation, never a SIGBUS in the middle of a copy.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import secrets
import stat
import time
from collections.abc import Collection
from functools import lru_cache

import numpy as np
import psutil

from ..errors import SharedMemoryExhausted
from ..wire.protocol import OWNER_LOCK, segment_owner, segment_prefix

DEFAULT_DIR = "/dev/shm"
# Test hook and safety valve: pretend the shm filesystem holds at most this many bytes.
LIMIT_ENV = "REACTOR_DIST_SHM_LIMIT"
ALIGN = 64            # each buffer starts on a cache line
GRANULE = 1 << 20     # segment sizes are rounded up to whole MiB so that sizes can be reused
PAGE = mmap.PAGESIZE

log = logging.getLogger("reactor_dist")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def mib(n: float) -> str:
    return f"{n / (1 << 20):.1f} MiB"


@lru_cache(maxsize=1)
def _start_time(pid: int) -> int:
    return int(psutil.Process(pid).create_time() * 100)


def owner_prefix() -> str:
    """The name prefix of every entry this process owns (recomputed after a fork)."""
    pid = os.getpid()
    return segment_prefix(pid, _start_time(pid), "")[:-1]


def new_runner_prefix() -> str:
    """The name prefix of one runner's entries."""
    return f"{owner_prefix()}.{secrets.token_hex(4)}"


def capacity(directory: str) -> tuple[int, int]:
    """(total, free) bytes of the shm filesystem, honouring REACTOR_DIST_SHM_LIMIT."""
    st = os.statvfs(directory)
    total, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    limit = os.environ.get(LIMIT_ENV)
    if limit:
        used = 0
        with os.scandir(directory) as entries:
            for entry in entries:
                try:
                    used += entry.stat(follow_symlinks=False).st_blocks * 512
                except OSError:
                    pass
        total = min(total, int(limit))
        free = max(0, min(free, total - used))
    return total, free


def allocation_error(directory: str, nbytes: int, what: str) -> SharedMemoryExhausted:
    total, free = capacity(directory)
    return SharedMemoryExhausted(
        f"cannot allocate {mib(nbytes)} of shared memory for {what}: {directory} has "
        f"{mib(total)} in total and {mib(free)} free. Give it more room: "
        f"`docker run --shm-size=16g ...` (Docker's default is 64 MB; on Kubernetes mount an "
        f"emptyDir with medium: Memory at /dev/shm), or send smaller payloads."
    )


class Segment:
    """One named /dev/shm file, mapped shared and kept mapped for reuse."""

    def __init__(self, directory: str, name: str, size: int, mm: mmap.mmap) -> None:
        self.directory, self.name, self.size, self.mm = directory, name, size, mm
        self.address = np.frombuffer(mm, np.uint8).ctypes.data if size else 0

    @property
    def buffer(self) -> mmap.mmap:
        return self.mm

    @property
    def path(self) -> str:
        return os.path.join(self.directory, self.name)

    @classmethod
    def create(cls, directory: str, name: str, size: int, what: str) -> Segment:
        _, free = capacity(directory)
        if size > free:
            raise allocation_error(directory, size, what)
        path = os.path.join(directory, name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                os.unlink(path)
                if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                    raise allocation_error(directory, size, what) from None
                raise
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        finally:
            os.close(fd)
        return cls(directory, name, size, mm)

    @classmethod
    def open(cls, directory: str, name: str) -> Segment:
        fd = os.open(os.path.join(directory, name), os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        finally:
            os.close(fd)
        return cls(directory, name, size, mm)

    def contains(self, address: int, nbytes: int) -> bool:
        return self.address <= address and address + nbytes <= self.address + self.size

    def close(self, unlink: bool = False) -> None:
        if unlink:
            unlink_quietly(self.path)
        try:
            self.mm.close()
        except BufferError:
            pass  # somebody still views it: the mapping lives until they let go


def unlink_quietly(path: str) -> None:
    """Unlink one of our files; never raises (what cannot be removed is logged)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("reactor_dist: could not remove %s: %s", path, exc)


def _own_file(path: str) -> bool:
    """Whether ``path`` is a regular file of this user (not followed if a link)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid()


class InputView:
    """One mapping of an input segment, at an address of its own (libc's mmap: Python's
    cannot map copy-on-write a file opened read-only); ``buffer`` is a ctypes array over
    it, which numpy and torch take as a plain writable buffer."""

    PROT, FLAGS = mmap.PROT_READ, mmap.MAP_SHARED

    def __init__(self, directory: str, name: str) -> None:
        fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        try:
            self.size = os.fstat(fd).st_size
            addr = _libc.mmap(None, self.size, self.PROT, self.FLAGS, fd, 0)
        finally:
            os.close(fd)
        if addr in (None, _MAP_FAILED):
            err = ctypes.get_errno()
            raise OSError(err, f"mmap of input segment {name} failed: {os.strerror(err)}")
        self.name, self.address = name, addr
        self.buffer = (ctypes.c_uint8 * self.size).from_address(addr)

    def close(self) -> None:
        if self.address:
            self.buffer = None
            _libc.munmap(self.address, self.size)
            self.address = 0


class SharedReadView(InputView):
    """A shared, read-only mapping of an input segment: the pages every rank sees before
    it writes (what a CUDA rank registers to copy inputs from: staging.InputStaging).
    Never written through (it is PROT_READ: a write would fault)."""


class PrivateView(InputView):
    """A copy-on-write mapping of an input segment: a rank's writes stay its own.

    Mapping 97 MB costs about one memcpy in page-table work, so a mapping is kept
    for the next input in the same segment as long as the rank did not write to
    it (no page turned private, read off /proc/self/pagemap); a written mapping is
    dropped and made anew.
    """

    PROT, FLAGS = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE

    def written(self, offset: int = 0, nbytes: int | None = None) -> bool:
        """Whether any page (of the ``nbytes`` from ``offset``; by default all) became
        the rank's own (copy-on-write happened)."""
        end = self.size if nbytes is None else offset + nbytes
        first = (self.address + offset) // PAGE
        count = (self.address + end + PAGE - 1) // PAGE - first
        try:
            with open("/proc/self/pagemap", "rb", buffering=0) as f:
                f.seek(first * 8)
                entries = np.frombuffer(f.read(count * 8), np.uint64)
        except OSError:
            return True  # cannot tell: assume written, stay correct
        present = (entries >> np.uint64(63)) & np.uint64(1)
        swapped = (entries >> np.uint64(62)) & np.uint64(1)
        file_backed = (entries >> np.uint64(61)) & np.uint64(1)
        return bool(np.any((present & (file_backed ^ np.uint64(1))) | swapped))


def remove_prefix(directory: str, prefix: str) -> int:
    """Unlink every entry of one runner; returns how many there were."""
    return remove_starting(directory, prefix + ".")


def remove_starting(directory: str, start: str, keep: Collection[str] = ()) -> int:
    """Unlink every entry of ours whose name starts with ``start`` (but ``keep``'s); how
    many."""
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        path = os.path.join(directory, name)
        if name.startswith(start) and name not in keep and _own_file(path):
            unlink_quietly(path)
            removed += 1
    return removed


def hold_owner_lock(directory: str, prefix: str) -> int:
    """Take the lock that says the runner of ``prefix`` lives; the returned descriptor
    holds it until closed (or the process dies).  It is locked before it gets its
    name, so that nobody ever sees it free while its owner lives."""
    path = os.path.join(directory, f"{prefix}.{OWNER_LOCK}")
    draft = os.path.join(directory, f".{OWNER_LOCK}-{secrets.token_hex(8)}")
    fd = os.open(draft, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(draft, path)
    except BaseException:
        os.close(fd)
        unlink_quietly(draft)
        raise
    return fd


def lock_state(path: str) -> str:
    """The owner lock at ``path``: "held" (its runner lives, or another user's or an
    unreadable one: not ours to judge), "free" (its owner is dead) or "gone" (removed:
    its runner is ending, by its own shutdown or its ranks' cleanup after its death)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return "gone"
    except OSError:
        return "held"
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return "free"
    except OSError:
        return "held"
    finally:
        os.close(fd)


def lock_free(path: str) -> bool:
    """Whether nobody holds the owner lock at ``path`` (its owner is dead)."""
    return lock_state(path) == "free"


RECLAIM_PASSES = 3  # reclaim_dead_owners looks again while a look removed something
DRAFT_AGE = 60.0  # seconds after which an unrenamed owner-lock draft is a dead runner's


def reclaim_dead_owners(directory: str) -> int:
    """Unlink our entries whose owning runner is gone (killed runners), its owner lock
    with them; never a live one's, nor another user's.

    start() calls it, and whatever a dead runner left is gone when it returns: also
    while that runner's ranks are still removing its entries themselves (one may have
    taken the lock first: a lock gone means its runner is ending), and while a
    SIGKILLed owner is still exiting or a zombie (its lock may be held a while yet,
    as the kernel tears down its memory).  A look again after one that removed
    something finds what a dying runner's ranks made meanwhile."""
    removed = 0
    for _ in range(RECLAIM_PASSES):
        once = _reclaim_once(directory)
        removed += once
        if not once:
            break
    return removed


def _reclaim_once(directory: str) -> int:
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    alive: dict[str, bool] = {}
    for name in names:
        path = os.path.join(directory, name)
        if name.startswith(f".{OWNER_LOCK}-"):
            removed += _reclaim_draft(path)
            continue
        key = segment_owner(name)
        if key is None or not _own_file(path):
            continue
        runner = ".".join(name.split(".")[:4])
        if runner not in alive:
            lock = f"{runner}.{OWNER_LOCK}"
            if lock in names:
                state = lock_state(os.path.join(directory, lock))
                alive[runner] = state == "held" and not owner_dying(*key)
            else:
                alive[runner] = owner_alive(*key)
        if not alive[runner]:
            unlink_quietly(path)
            removed += 1
    return removed


def _reclaim_draft(path: str) -> int:
    """An owner lock's draft (hold_owner_lock) left by a runner killed before it named
    it: free and older than DRAFT_AGE (a live one is locked microseconds after it is
    made, and named at once)."""
    try:
        age = time.time() - os.lstat(path).st_mtime
    except OSError:
        return 0
    if age < DRAFT_AGE or not _own_file(path) or lock_state(path) != "free":
        return 0
    unlink_quietly(path)
    return 1


def owner_alive(pid: int, started_hex: str) -> bool:
    """Whether process ``pid`` started at ``started_hex`` lives (a zombie, or a process
    that a SIGKILL is ending, does not)."""
    try:
        started = int(psutil.Process(pid).create_time() * 100)
    except psutil.AccessDenied:
        return True  # somebody else's live process: not ours to judge
    except (psutil.NoSuchProcess, ValueError):
        return False
    return f"{started:x}" == started_hex and not owner_dying(pid, started_hex)


SIGKILL_BIT = 1 << (9 - 1)  # SIGKILL in /proc's SigPnd and ShdPnd masks
PF_EXITING = 0x4  # a task's flag in /proc/<pid>/stat from the start of its exit


def owner_dying(pid: int, started_hex: str) -> bool:
    """Whether process ``pid``, the one started at ``started_hex`` (not another process
    that reuses the pid, nor one in another pid namespace), is past its death: killed
    by a SIGKILL not yet acted on, or exiting in every thread (a zombie too; not a
    process whose first thread alone has ended).  Its owner lock stays held until the
    kernel closes its files, after its memory is torn down (with a GPU's, a fraction
    of a second): its entries are for removing now all the same."""
    try:  # none here with that pid and start: not ours to judge (another namespace's?)
        if f"{int(psutil.Process(pid).create_time() * 100):x}" != started_hex:
            return False
    except (psutil.Error, ValueError):
        return False
    try:
        with open(f"/proc/{pid}/status") as f:
            pending = dict(line.split(":", 1) for line in f if ":" in line)
        if any(int(pending.get(mask, "0").strip() or "0", 16) & SIGKILL_BIT
               for mask in ("ShdPnd", "SigPnd")):
            return True
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return True  # it was here a moment ago: gone since
    except (OSError, ValueError):
        return False
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                flags = int(f.read().rsplit(")", 1)[1].split()[6])
        except FileNotFoundError:
            continue  # this thread has ended
        except (OSError, ValueError, IndexError):
            return False
        if not flags & PF_EXITING:
            return False
    return True
