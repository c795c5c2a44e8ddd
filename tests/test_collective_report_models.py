"""A hang inside one of each third-party model's own collectives is named (issue 45):
transformers' tensor parallelism (DTensor) and diffusers' Ulysses, at world_size 2 (their
tiny configs split their heads in two, not three).  Slow: make test-slow."""

from __future__ import annotations

import re

import pytest
from collective_model_workers import LateLlama, LateWan

from reactor_dist import DistributedRunner, WorkerTimeout
from workers.hf_llama import save_tiny_llama

pytestmark = pytest.mark.slow
HEADLINE = re.compile(r"rank 1 never entered ((funcol\.)?[a-z_]+) #1 of call 2; "
                      r"rank 0 (waits in|entered) it")


def hang(runner: DistributedRunner, value: object) -> str:
    runner.generate(value[1])  # call 1: the model runs whole
    with pytest.raises(WorkerTimeout) as caught:
        runner.generate(value)
    text = str(caught.value)
    first = text.split("\n")[0]
    match = HEADLINE.fullmatch(first)
    assert match, first
    record = {f.rank: f.collective for f in caught.value.failures}
    assert re.match(rf"(waits in|queued) {re.escape(match.group(1))} #1 of call 2 ", record[0])
    return first


def test_a_rank_late_to_the_tensor_parallel_llamas_collective_is_named(tmp_path):
    path = save_tiny_llama(str(tmp_path / "llama"), seed=0)
    with DistributedRunner(LateLlama, world_size=2, device="cpu", load_kwargs={"path": path},
                           start_timeout=300, call_timeout=20, shutdown_grace=1.0) as runner:
        print(hang(runner, ("hang", list(range(3, 35)))))


def test_a_rank_late_to_the_ulysses_wans_collective_is_named():
    with DistributedRunner(LateWan, world_size=2, device="cpu", start_timeout=300,
                           call_timeout=20, shutdown_grace=1.0) as runner:
        print(hang(runner, ("hang", 3)))
