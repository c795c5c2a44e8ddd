"""The third-party models of workers/ with a rank that hangs before the model's first
collective of a call (issue 45): ``generate(("hang", x))`` sleeps on the last rank
before running ``generate(x)``, so that the others wait in the model's own collective."""

from __future__ import annotations

import time
from typing import Any

from workers.hf_llama import LlamaTP
from workers.wan_context import WanContextParallel


def late(worker: Any, value: Any) -> tuple[bool, Any]:
    if isinstance(value, tuple) and value and value[0] == "hang":
        if worker.rank == worker.world_size - 1:
            time.sleep(60)
        return True, value[1]
    return False, value


class LateLlama(LlamaTP):
    def generate(self, token_ids: Any, /) -> Any:
        return super().generate(late(self, token_ids)[1])


class LateWan(WanContextParallel):
    def generate(self, seed: Any, /) -> Any:
        return super().generate(late(self, seed)[1])
