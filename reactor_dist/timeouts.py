"""Timeouts: ``None`` means no limit, and any positive number of seconds works, however
large.

The waits underneath take bounded values: ZeroMQ's ``RCVTIMEO`` is a C ``int`` of
milliseconds (about 24.8 days), ``threading``'s waits stop at ``threading.TIMEOUT_MAX``,
Ray and torch turn seconds into 64-bit counts.  So a wait never hands its whole
timeout to one of them: it waits in slices of at most :data:`SLICE` and loops to the
real deadline (:func:`wait_ms`, :func:`slice_of`), and a library that keeps a timeout
of its own gets at most :data:`LIBRARY_CAP` (:func:`for_library`).  The torch.distributed
group's own timeout, once the ranks serve calls, follows ``call_timeout``
(:func:`for_group`).
"""

from __future__ import annotations

import math
import numbers
import time
from typing import Any

SLICE = 24 * 3600.0  # seconds: the longest single wait handed to ZeroMQ, a Condition, a loop
SLICE_MS = int(SLICE * 1000)
LIBRARY_CAP = 100 * 365 * 24 * 3600.0  # a century: fits torch's and Ray's 64-bit counts
# The group's timeout past call_timeout: the runner times the call out and collects the
# silent ranks' stacks before the group aborts their collectives (NCCL ends the process).
GROUP_MARGIN = 60.0
GROUP_WITHOUT_CALL_TIMEOUT = 1800.0  # call_timeout=None: 30 min (torch's gloo default)


def check_timeout(name: str, value: Any, zero: bool = False) -> float | None:
    """``value`` as seconds, or None for no limit (``None`` or ``math.inf``); ValueError
    for anything else than a positive number (``zero``: or 0, "never wait")."""
    least = "a number of seconds >= 0" if zero else "a positive number of seconds"
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be {least} or None (no limit), "
                         f"got {value!r} of type {type(value).__name__}")
    seconds = float(value)
    if math.isnan(seconds) or seconds < 0 or (seconds == 0 and not zero):
        raise ValueError(f"{name} must be {least} or None (no limit), got {value!r}")
    return None if math.isinf(seconds) else seconds


def check_grace(value: Any) -> float:
    """``shutdown_grace`` as seconds: 0 (no grace) or more, ``math.inf`` for None (wait
    for the graceful exit however long; Ctrl-C still ends the ranks at once)."""
    if value is None:
        return math.inf
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or \
            math.isnan(value) or value < 0:
        raise ValueError(f"shutdown_grace must be 0 or more seconds, or None (no limit), "
                         f"got {value!r} of type {type(value).__name__}")
    return float(value)


def deadline_of(timeout: float | None) -> float:
    """The ``time.monotonic()`` deadline of ``timeout`` seconds from now; ``math.inf``
    for no limit."""
    return math.inf if timeout is None else time.monotonic() + timeout


def wait_ms(seconds: float | None) -> int:
    """A receive's RCVTIMEO for a wait of ``seconds`` (None or inf: no limit): rounded
    up to the next millisecond, at most :data:`SLICE_MS`; the caller loops on."""
    if seconds is None or seconds >= SLICE:
        return SLICE_MS
    return int(max(0.0, seconds) * 1000) + 1


def slice_of(seconds: float | None) -> float:
    """A wait of ``seconds`` (None: no limit) cut to at most :data:`SLICE`."""
    return SLICE if seconds is None else min(max(0.0, seconds), SLICE)


def for_group(call_timeout: float | None) -> float:
    """The timeout of the group's collectives once start() is done: ``call_timeout`` plus
    :data:`GROUP_MARGIN`, or :data:`GROUP_WITHOUT_CALL_TIMEOUT` without one, so that a
    rank that raised before a collective does not leave the others waiting in it (on
    their GPUs) for ``start_timeout``."""
    if call_timeout is None:
        return GROUP_WITHOUT_CALL_TIMEOUT
    return for_library(call_timeout + GROUP_MARGIN)


def for_library(seconds: float | None) -> float:
    """A timeout for a library that keeps it itself (torch's store and group, Ray):
    at most :data:`LIBRARY_CAP`, which stands for no limit."""
    return LIBRARY_CAP if seconds is None else min(seconds, LIBRARY_CAP)
