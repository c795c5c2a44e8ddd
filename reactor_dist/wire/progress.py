"""Load progress: what each rank is doing while ``start()`` waits.

A rank sends a PROGRESS message (``Kind.PROGRESS``) when it enters a phase
(:data:`IMPORTING` torch before the handshake, :data:`FORMING` the group,
:data:`LOADING`: importing the worker class and running ``load()``) and whenever
its worker calls ``self.report_progress(done, total, unit)`` in ``load()``
(:class:`Reporter`, at most every :data:`REPORT_EVERY` seconds but always the last
step).  Only counts cross processes: the caller measures the elapsed time itself.

The start-up handshake hands each message to a :class:`Display`: tqdm bars (one per
rank) when tqdm is installed (``reactor-dist[progress]``) and stderr is a terminal,
else INFO records on the ``reactor_dist`` logger (a phase as it begins, a worker's
report at most every :data:`LOG_EVERY` seconds per rank and its last step).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import Any

from .protocol import Field, Kind

log = logging.getLogger("reactor_dist")

IMPORTING, FORMING, LOADING = "importing", "forming the torch group", "loading"
REPORT_EVERY = 0.05  # a rank's worker reports at most this often (seconds)
LOG_EVERY = 1.0      # the log display: a rank's worker progress at most this often


class Reporter:
    """A rank's side: sends PROGRESS (throttled) through ``send``."""

    def __init__(self, send: Callable[[dict[str, Any]], None]) -> None:
        self.send = send
        self.last = 0.0

    def phase(self, phase: str) -> None:
        self.send({Field.KIND: Kind.PROGRESS, Field.SEQ: 0, Field.PHASE: phase})

    def report(self, done: Any, total: Any = None, unit: Any = "") -> None:
        """``DistributedWorker.report_progress``: ``done`` of ``total`` ``unit``."""
        done = float(done)
        total = None if total is None else float(total)
        now = time.monotonic()
        if now - self.last < REPORT_EVERY and (total is None or done < total):
            return
        self.last = now
        message = {Field.KIND: Kind.PROGRESS, Field.SEQ: 0, Field.PHASE: LOADING,
                   Field.DONE: done, Field.UNIT: str(unit)}
        if total is not None:
            message[Field.TOTAL] = total
        self.send(message)


def describe(done: float, total: float | None, unit: str) -> str:
    count = f"{done:g}" if total is None else f"{done:g}/{total:g}"
    return f"{count} {unit}".rstrip()


class Display:
    """The caller's side: log lines, or tqdm bars in a terminal."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.began = time.monotonic()
        self.phases: dict[int, str] = {}
        self.logged: dict[int, float] = {}
        self.bars: dict[int, Any] = {}
        self.tqdm = tqdm_if_terminal()

    def update(self, header: dict[str, Any]) -> None:
        rank, phase = header[Field.RANK], header.get(Field.PHASE)
        if not isinstance(phase, str):
            return
        elapsed = time.monotonic() - self.began
        done, total, unit = header.get(Field.DONE), header.get(Field.TOTAL), \
            str(header.get(Field.UNIT) or "")
        if self.tqdm is not None:
            self.show_bar(rank, phase, done, total, unit)
            return
        if done is None:
            if self.phases.get(rank) != phase:
                self.phases[rank] = phase
                log.info("rank %d: %s (%.1f s into start)", rank, phase, elapsed,
                         extra={"rank": rank, "phase": phase})
            return
        now = time.monotonic()
        last_step = total is not None and done >= total
        if not last_step and now - self.logged.get(rank, 0.0) < LOG_EVERY:
            return
        self.logged[rank] = now
        log.info("rank %d: %s %s (%.1f s into start)", rank, phase,
                 describe(done, total, unit), elapsed,
                 extra={"rank": rank, "phase": phase, "done": done, "total": total,
                        "unit": unit})

    def show_bar(self, rank: int, phase: str, done: Any, total: Any, unit: str) -> None:
        bar = self.bars.get(rank)
        if bar is None:
            bar = self.bars[rank] = self.tqdm(desc=f"rank {rank}", position=rank,
                                              leave=False, file=sys.stderr)
        bar.set_description_str(f"rank {rank}: {phase}", refresh=False)
        if done is not None:
            bar.total, bar.unit = total, unit or "it"
            bar.n = done
        bar.refresh()

    def close(self) -> None:
        for bar in self.bars.values():
            bar.close()
        self.bars.clear()


def tqdm_if_terminal() -> Any:
    """tqdm's class, when it is installed and stderr is a terminal; else None."""
    try:
        if not sys.stderr.isatty():
            return None
        from tqdm import tqdm
    except (ImportError, AttributeError, ValueError):
        return None
    return tqdm
