"""A worker that logs through ``logging`` on every rank (tests/test_logging.py): its
records must reach the caller's logging as records."""

from __future__ import annotations

import logging

from reactor_dist import DistributedWorker


class LogsRecords(DistributedWorker):
    def load(self) -> None:
        logging.getLogger("model").info("loaded on rank %s", self.rank)

    def generate(self, x: int, /) -> int:
        log = logging.getLogger("model")
        log.debug("debug %d", x)  # below the level the application set: never sent
        log.info("step %d", x, extra={"frame": x * 2, "tags": ["a", "b"]})
        try:
            raise ValueError("bad frame")
        except ValueError:
            log.exception("step %d failed", x)
        logging.getLogger("model.noisy").warning("noisy %d", x)  # its level: ERROR
        print("plain line", flush=True)
        return x

    def reset(self) -> None:
        pass


class LogsInEveryCall(DistributedWorker):
    """Every rank logs a WARNING in every call just before it answers (issue 46, item 3):
    ``("ok", n)`` returns n, ``("raise", n)`` raises ValueError on every rank,
    ``("stream", n)`` yields 0, 1, 2 and logs after the last item."""

    def generate(self, x: tuple[str, int], /):
        mode, n = x
        if mode == "stream":
            return self.items(n)
        log = logging.getLogger("model.calls")
        log.warning("call %d %s", n, "x" * 2000)  # long: one write, but not a small one
        if mode == "raise":
            raise ValueError(f"call {n}")
        return n

    def items(self, n: int):
        yield from range(3)
        logging.getLogger("model.calls").warning("call %d %s", n, "x" * 2000)

    def reset(self) -> None:
        pass
