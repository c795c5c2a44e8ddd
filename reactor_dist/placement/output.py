"""A rank's stdout and stderr: forwarded line by line, the last lines kept.

Both streams share one pipe.  A reader thread forwards each line to the
application's stderr, prefixed ``[rank N]`` (or, with ``rank_output="log"``, as an
INFO record of the ``reactor_dist.rank`` logger, with a ``rank`` attribute), and
keeps the last :data:`TAIL_LINES` for crash and timeout reports.  A line that holds
one of the rank's log records goes to the application's logging as that record
(:mod:`reactor_dist.wire.log_records`).

A faulthandler dump the runner asked for on a timeout (reactor_dist.placement.stacks) is shown
in the error alone: muted while the runner waits for it, and, when it comes after the
error was raised (the rank was stopped, or stuck in the kernel), dropped to a DEBUG
record rather than printed on the caller's stderr long after the fact.
"""

from __future__ import annotations

import collections
import fcntl
import logging
import os
import re
import select
import struct
import sys
import termios
import threading
import time

from ..wire import log_records

TAIL_LINES = 200  # enough for a faulthandler dump of every thread
OUTPUT_MODES = ("stderr", "log")  # where a rank's lines go (DistributedRunner rank_output=)
rank_log = logging.getLogger("reactor_dist.rank")
log = logging.getLogger("reactor_dist")
# The first line of each thread's block in a faulthandler dump.
DUMP_HEADER = re.compile(r"(Current thread|Thread) 0x[0-9a-f]+ \(most recent call first\):$")


class RankOutput:
    """The reader of one rank's output pipe."""

    def __init__(self, rank: int, fd: int, mode: str = "stderr", label: str = "") -> None:
        self.rank = rank
        self.label = label or f"rank {rank}"  # its lines' prefix: "rank 1", "spare 0"
        self.to_log = mode == "log"
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.lines_seen = 0
        self.last_output = 0.0  # monotonic time of the latest line
        self.muted = False  # kept, not forwarded (a stack dump the caller's error shows)
        self.dump_headers = 0  # faulthandler thread headers seen (stacks.py waits)
        self.late_dump_owed = False  # asked for stacks, none came in time: drop them
        self._in_late_dump = False
        self._partial = b""
        self._lock = threading.Lock()
        self._fd = fd
        self._reader = threading.Thread(target=self._pump, name=f"reactor-dist-rank{rank}-out",
                                        daemon=True)
        self._reader.start()

    def _pump(self) -> None:
        """Forward the rank's output; reads happen under a lock so that drain() can
        take the rest of the pipe itself and know that nothing is half-processed."""
        os.set_blocking(self._fd, False)
        readable = select.poll()
        readable.register(self._fd, select.POLLIN | select.POLLHUP)
        while True:
            readable.poll()
            with self._lock:
                if not self._read_some():
                    break
        with self._lock:
            if self._partial:
                self._emit(self._partial)
                self._partial = b""

    def _read_some(self) -> bool:
        """Read what the pipe holds now; False at end of file."""
        try:
            data = os.read(self._fd, 65536)
        except BlockingIOError:
            return True  # drain() took it first
        except OSError:
            return False
        if not data:
            return False
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            self._emit(line)
        return True

    def _emit(self, raw: bytes) -> None:
        line = raw.decode("utf-8", "replace").rstrip("\r")
        record = log_records.decode(line)
        if record is not None:  # a log record of the rank's: to the caller's logging
            self.tail.extend(log_records.as_text(record))
            self.lines_seen += 1
            self.last_output = time.monotonic()
            if not self.muted:
                log_records.handle(record, self.label)
            return
        self.tail.append(line)
        self.lines_seen += 1
        self.last_output = time.monotonic()
        header = DUMP_HEADER.match(line) is not None
        if header:
            self.dump_headers += 1
        if self.muted:
            return
        if self._late(line, header):
            log.debug("[%s] (a stack dump that came after its timeout, not shown) %s",
                      self.label, line)
            return
        if self.to_log:
            rank_log.info("[%s] %s", self.label, line, extra={"rank": self.rank})
            return
        try:
            sys.stderr.write(f"[{self.label}] {line}\n")
            sys.stderr.flush()
        except Exception:
            pass  # a closed stderr must not kill the pump

    def _late(self, line: str, header: bool) -> bool:
        """Whether ``line`` belongs to a dump owed since a timeout: from its first thread
        header to the first line that no dump has (not a header, blank or indented)."""
        if line.startswith("Fatal Python error"):
            self.late_dump_owed = False  # the dump that follows is a crash's: shown
        if self._in_late_dump:
            self._in_late_dump = header or not line.strip() or line.startswith("  ")
            return self._in_late_dump
        if header and self.late_dump_owed:
            self.late_dump_owed, self._in_late_dump = False, True
        return self._in_late_dump

    def _pending_bytes(self) -> int:
        try:
            return struct.unpack("i", fcntl.ioctl(self._fd, termios.FIONREAD, b"\0\0\0\0"))[0]
        except OSError:
            return 0

    def drain(self) -> None:
        """Take in everything the rank wrote so far (after it died: all of it, in the pipe
        by now).  An empty pipe while the pump processes nothing costs one ioctl."""
        if self._pending_bytes() <= 0 and self._lock.acquire(blocking=False):
            self._lock.release()  # nothing read and half-processed, nothing to read
            return
        with self._lock:
            while self._pending_bytes() > 0 and self._read_some():
                pass

    def last_lines(self, n: int = 20) -> list[str]:
        lines = list(self.tail)[-n:]
        if self._partial:
            lines.append(self._partial.decode("utf-8", "replace"))
        return lines

    def report_lines(self) -> list[str]:
        """The last lines; after a fatal error (faulthandler's dump on SIGSEGV, SIGABRT,
        ...) the lines before it, its cause and the crashing thread's stack, which the
        dump of the other threads would otherwise push out of the last lines."""
        lines = self.last_lines(TAIL_LINES)
        fatal = max((i for i, line in enumerate(lines) if line.startswith("Fatal Python error")),
                    default=None)
        if fatal is None:
            return lines[-20:]
        shown = lines[max(0, fatal - 5):fatal + 1]
        current = next((i for i in range(fatal, len(lines))
                        if lines[i].startswith("Current thread")), None)
        if current is not None:
            end = next((i for i in range(current, len(lines)) if not lines[i].strip()), len(lines))
            shown += lines[current:end]
        return shown

    def join(self, timeout: float) -> None:
        self._reader.join(timeout=timeout)
