"""A rank's ``logging`` records, handled by the application's own logging.

A rank's stdout and stderr reach the caller line by line (:mod:`reactor_dist.placement.output`).
Its log records travel the same pipe, one line each: :data:`RECORD_MARK` and the
record as JSON (:func:`encode`).  The caller rebuilds each as a ``LogRecord`` of the
same logger name, level and message, with ``rank`` and ``pid`` on it, the exception's
text (``exc_text``) and the extra fields kept, and hands it to that logger: the
handlers and formatters the application configured (JSON ones too) apply::

    rank (log_records.install)                       caller (RankOutput, log_records.handle)
    logging.getLogger("model").warning(...)
      RecordLine handler on the root logger  ->  line "\\x1ereactor-dist-record {...}"
                                                 logging.getLogger("model").handle(record)

The ranks learn the application's levels at start (``Bootstrap.log_levels``: the root
logger's and every logger's that has one), so a record below them is never made at
all.  Where the application configured no handler for the record, it is printed as
before: ``[rank N] message`` on stderr.  Ranks placed by Ray keep plain lines (Ray
forwards their output).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

from .protocol import RECORD_MARK

# What a LogRecord has of its own: everything else on it is an extra field.
STANDARD = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime"}
SENT = ("name", "levelno", "levelname", "pathname", "filename", "module", "lineno",
        "funcName", "created", "msecs", "thread", "threadName", "processName", "process",
        "exc_text", "stack_info", "taskName")


def levels() -> dict[str, int]:
    """The application's levels now: the root logger's (key "") and every logger's that
    has one of its own."""
    found = {"": logging.getLogger().level}
    for name, logger in list(logging.Logger.manager.loggerDict.items()):
        if isinstance(logger, logging.Logger) and logger.level != logging.NOTSET:
            found[name] = logger.level
    return found


def encode(record: logging.LogRecord, rank: int | None) -> str:
    """One record as one line (without its newline)."""
    fields: dict[str, Any] = {key: getattr(record, key, None) for key in SENT}
    fields["msg"] = record.getMessage()
    if record.exc_info and not record.exc_text:
        fields["exc_text"] = logging.Formatter().formatException(record.exc_info)
    extra = {key: value for key, value in vars(record).items() if key not in STANDARD}
    fields["extra"] = json.loads(json.dumps(extra, default=repr))
    fields["rank"] = rank
    return RECORD_MARK + json.dumps(fields, default=repr)


class RecordLine(logging.Handler):
    """In a rank: each record as one line on stderr (one write: whole, never mixed)."""

    def __init__(self, rank: Callable[[], int | None]) -> None:
        super().__init__(logging.NOTSET)
        self.rank = rank
        self.writing = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        global _written
        try:
            line = (encode(record, self.rank()) + "\n").encode("utf-8", "replace")
            with self.writing:
                sys.stderr.flush()  # the lines printed before it come first
                os.write(2, line)
                _written += 1
        except Exception:
            self.handleError(record)


_written = 0  # records this rank wrote so far (RecordLine)


def written() -> int:
    """How many records this rank wrote so far: a reply says whether its call wrote any
    (Field.LOGGED), so that the caller takes them in before it returns."""
    return _written


def install(levels: dict[str, int], rank: Callable[[], int | None]) -> None:
    """In a rank, before the worker is imported: the application's levels, and every
    record to the caller."""
    root = logging.getLogger()
    for name, level in levels.items():
        logging.getLogger(name or None).setLevel(level)
    root.addHandler(RecordLine(rank))


def decode(line: str) -> logging.LogRecord | None:
    """The record a line of a rank's output holds (None: it holds none)."""
    if not line.startswith(RECORD_MARK):
        return None
    try:
        fields = json.loads(line[len(RECORD_MARK):])
        extra = fields.pop("extra", None) or {}
        record = logging.makeLogRecord({**extra, **fields, "args": None})
    except (ValueError, TypeError):
        return None
    record.pid = fields.get("process")
    return record


def handle(record: logging.LogRecord, label: str) -> None:
    """In the caller: the record goes to its logger's handlers, as if logged here; with
    none configured, it is printed as a rank's line (``[rank N] message``)."""
    logger = logging.getLogger(record.name)
    if not logger.isEnabledFor(record.levelno):
        return
    if logger.hasHandlers():
        logger.handle(record)
        return
    text = record.getMessage() + (f"\n{record.exc_text}" if record.exc_text else "")
    try:
        for line in text.splitlines() or [""]:
            sys.stderr.write(f"[{label}] {line}\n")
        sys.stderr.flush()
    except Exception:
        pass  # a closed stderr must not kill the pump


def as_text(record: logging.LogRecord) -> list[str]:
    """The lines a record stands for in a rank's last lines (crash reports)."""
    text = f"{record.levelname}:{record.name}:{record.getMessage()}"
    return (text + (f"\n{record.exc_text}" if record.exc_text else "")).splitlines()
