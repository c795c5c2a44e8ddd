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
