"""Process hygiene shared by the floors and the baselines: leave no process behind."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def child_env() -> dict[str, str]:
    """Let a child find ``benchmarks`` whatever directory the run was started from."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    return env


def stop_processes(procs: Iterable[subprocess.Popen[bytes]], grace_s: float = 2.0) -> None:
    """Wait for a clean exit, then SIGKILL whatever is still running."""
    procs = list(procs)
    for p in procs:
        try:
            p.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


class ClosesOnExit:
    """``with pool:`` closes the pool at the end of the block."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
