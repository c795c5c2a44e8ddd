"""A silent rank's stacks for a WorkerTimeout, or why there are none.

On a timeout the runner asks each silent rank for every thread's stack: SIGUSR1, which
faulthandler answers (server.main registers it) by writing them to the rank's output,
muted meanwhile so that they show in the error alone.  Two cases get words instead:

- a *stopped* rank (state T, or t under a tracer) cannot answer; it is named as
  stopped, with the signal that stopped it where this process can know it (a rank's
  parent reads it with ``waitid``), and how to resume it.  It is not signalled: its
  dump would only come once resumed, and a debugger holding it would see the signal.
- a rank that got SIGUSR1 but wrote no dump within :data:`DUMP_WAIT` owes one; its
  output drops that dump when it comes (output.RankOutput.late_dump_owed), rather
  than print it on the caller's stderr after the error was raised.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from typing import Protocol

import psutil

from .output import RankOutput


class RankProcess(Protocol):
    """What the stacks need of a local rank's process (local.RankProcess)."""

    rank: int
    pid: int
    launcher_pid: int
    pidfd: int
    output: RankOutput

DUMP_WAIT = 0.5  # seconds the silent ranks get to write their dumps
QUIET = 0.03  # a dump is complete once its rank wrote nothing for this long
# The innermost frame of reactor_dist in a dump of a rank's own threads: the runner watch
# (server.watch_runner), the group's abort thread (group.watch_abort, in signal.sigwait
# below it) and the flight recorder's (flight_recorder.answer, likewise), each in its
# function ``wait``.
OWN_THREAD = re.compile(
    r'reactor_dist[/\\]rank[/\\](server|group|flight_recorder)\.py", line \d+ in wait$')
STOPPING = "SIGSTOP, SIGTSTP, SIGTTIN or SIGTTOU"  # what may have stopped a process


class Dump:
    """One silent rank's stacks on their way: SIGUSR1 goes out at once (not to a stopped
    rank, which gets words instead), and :meth:`text` waits for the dump until
    :data:`DUMP_WAIT` after it, so that ranks asked one after the other dump side by side
    (base.Ranks.stacks asks them all first)."""

    def __init__(self, proc: RankProcess) -> None:
        self.proc = proc
        self.stopped = stopped_note(proc)
        self.headers = proc.output.dump_headers  # the dumps seen before this one
        self.deadline = time.monotonic() + DUMP_WAIT
        if self.stopped is None:
            proc.output.muted = True
            with contextlib.suppress(OSError):
                os.kill(proc.launcher_pid, signal.SIGUSR1)

    def complete(self) -> bool:
        """A new dump began and its rank has written nothing for :data:`QUIET`."""
        output = self.proc.output
        return output.dump_headers > self.headers and \
            time.monotonic() - output.last_output > QUIET

    def text(self) -> str:
        """The rank's stacks, or why there are none."""
        if self.stopped is not None:
            return self.stopped
        proc = self.proc
        while time.monotonic() < self.deadline and not self.complete():
            time.sleep(0.01)
        late = proc.output.dump_headers == self.headers
        proc.output.late_dump_owed = late  # set before the output is unmuted
        proc.output.muted = False
        return no_dump(proc) if late else dump_of(proc)


def stopped_note(proc: RankProcess) -> str | None:
    """What to say of a rank whose process is stopped; None when it runs."""
    for pid in dict.fromkeys((proc.launcher_pid, proc.pid)):  # where its code runs first
        try:
            status = psutil.Process(pid).status()
        except psutil.Error:
            continue
        if status == psutil.STATUS_TRACING_STOP:
            return (f"rank {proc.rank} (pid {pid}) is in a tracing stop (state t: a debugger "
                    f"or tracer holds it), so it cannot answer nor show its stacks: let the "
                    f"tracer continue it or detach")
        if status == psutil.STATUS_STOPPED:
            signum = stop_signal(proc) if pid == proc.pid else None
            how = signal.Signals(signum).name if signum else STOPPING
            return (f"rank {proc.rank} (pid {pid}) is stopped (state T, by {how}), so it "
                    f"cannot answer nor show its stacks: resume it with kill -CONT {pid}")
    return None


def stop_signal(proc: RankProcess) -> int | None:
    """The signal that stopped our child ``proc``: its parent alone can know it
    (``waitid`` with WNOWAIT, which leaves the notice for the next look)."""
    options = os.WSTOPPED | os.WNOHANG | os.WNOWAIT
    try:
        info = (os.waitid(os.P_PIDFD, proc.pidfd, options) if proc.pidfd >= 0 else
                os.waitid(os.P_PID, proc.pid, options))
    except (AttributeError, OSError):
        return None
    if info is None or info.si_code != os.CLD_STOPPED:
        return None
    with contextlib.suppress(ValueError):
        return int(signal.Signals(info.si_status))
    return None


def no_dump(proc: RankProcess) -> str:
    """A rank that wrote no stacks in time (stuck in the kernel, or stopped meanwhile)."""
    lines = proc.output.last_lines(10) or ["(no output)"]
    return (f"rank {proc.rank} (pid {proc.pid}) wrote no stacks within {DUMP_WAIT:g} s of "
            f"SIGUSR1 (stuck in a system call or the kernel?); its last output:\n" +
            "\n".join(f"    {line}" for line in lines))


def dump_of(proc: RankProcess) -> str:
    """A rank's faulthandler dump, as its output pump saw it."""
    return f"rank {proc.rank} (pid {proc.pid}), last output:\n" + "\n".join(
        f"    {line}" for line in without_own_threads(proc.output.last_lines(30)))


def without_own_threads(lines: list[str]) -> list[str]:
    """A faulthandler dump without the blocks of reactor_dist's own threads."""
    kept: list[str] = []
    block: list[str] = []
    for line in [*lines, ""]:
        if line.strip():
            block.append(line)
            continue
        ours = next((frame for frame in block[1:] if "reactor_dist" in frame), "")
        if not OWN_THREAD.search(ours):  # its innermost frame of ours (below: a library's)
            kept += block + ([line] if block else [])
        block = []
    return kept[:-1] if kept and kept[-1] == "" else kept
