"""The log lines of a fault and of the restart after it (issue 46, item 4): one line
each, readable on its own.

A fault's message can run to many lines (a crash report's last output, a timeout's
stacks, remote tracebacks): the exception keeps them all; its log record is
:func:`one_line`, and a restart's record names the fault by :func:`headline` alone.
"""

from __future__ import annotations

import re

REPORT_END = "; last output:"  # a crash report's header (local.RankProcess)


def first_line(exc: BaseException) -> str:
    """An exception's first line, for a one-line summary (a bare KeyboardInterrupt has
    none: its type says it)."""
    lines = str(exc).splitlines()
    return lines[0].rstrip(":") if lines else type(exc).__name__


def one_line(exc: BaseException) -> str:
    """``exc``'s message on one line: a crash report's last output shrinks to its last
    line, each rank's; whatever else follows the first line stays in the error."""
    segments: list[list[str]] = []
    for line in str(exc).splitlines():
        if line.startswith(" ") and segments:
            segments[-1].append(line.strip())
        elif line.strip():
            segments.append([line.rstrip()])
    if not segments:
        return type(exc).__name__
    said = []
    for header, *output in segments:
        if not header.endswith(REPORT_END):
            if said:
                break  # a traceback, stacks: in the error's text
            said.append(header)
            continue
        last = output[-1] if output and output[-1] != "(no output)" else None
        said.append(header.removesuffix(REPORT_END) +
                    (f"; last output line: {last!r}" if last else "; no output"))
    return "; ".join(said)


def headline(exc: BaseException) -> str:
    """What happened, without the details: ``WorkerCrashed (rank 1 died during
    generate() (call 6))``."""
    first = re.split(r": |; | \(rank ", one_line(exc), maxsplit=1)[0]
    return f"{type(exc).__name__} ({first})" if first else type(exc).__name__
