"""A hang inside one of each third-party model's own collectives is named (issue 45):
transformers' tensor parallelism (DTensor) and diffusers' Ulysses, at world_size 2 and 3
(their tiny configs split heads, MLPs and tokens in two and in three).  Slow: make
test-slow."""

from __future__ import annotations

import re

import pytest
from collective_model_workers import LateLlama, LateWan

from reactor_dist import DistributedRunner, WorkerTimeout
from workers.hf_llama import save_tiny_llama

pytestmark = pytest.mark.slow
# What the other ranks do, one or two parts: "rank 0 waits in it", "ranks 0 and 1 wait in
# it", "rank 0 waits in it, rank 1 entered it" (a functional collective is queued).
PART = r"(rank \d+ (waits in|entered) it|ranks \d+(, \d+)* and \d+ (wait in|entered) it)"


def hang(runner: DistributedRunner, value: object) -> str:
    """The last rank sleeps before call 2's first collective: the first line names it,
    the collective, and every other rank as in it (each one's failure record too)."""
    late = runner.world_size - 1
    runner.generate(value[1])  # call 1: the model runs whole
    with pytest.raises(WorkerTimeout) as caught:
        runner.generate(value)
    first = str(caught.value).split("\n")[0]
    match = re.fullmatch(rf"rank {late} never entered ((funcol\.)?[a-z_]+) #1 of call 2; "
                         rf"(?P<others>{PART}(, {PART})?)", first)
    assert match, first
    assert sorted(map(int, re.findall(r"\d+", match["others"]))) == list(range(late)), first
    record = {f.rank: f.collective for f in caught.value.failures}
    for rank in range(late):
        assert re.match(rf"(waits in|queued) {re.escape(match.group(1))} #1 of call 2 ",
                        record[rank]), record
    return first


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_rank_late_to_the_tensor_parallel_llamas_collective_is_named(tmp_path, world_size):
    path = save_tiny_llama(str(tmp_path / "llama"), seed=0)
    with DistributedRunner(LateLlama, world_size=world_size, device="cpu",
                           load_kwargs={"path": path}, start_timeout=300, call_timeout=20,
                           shutdown_grace=1.0) as runner:
        print(hang(runner, ("hang", list(range(3, 35)))))


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_rank_late_to_the_ulysses_wans_collective_is_named(world_size):
    with DistributedRunner(LateWan, world_size=world_size, device="cpu", start_timeout=300,
                           call_timeout=20, shutdown_grace=1.0) as runner:
        print(hang(runner, ("hang", 3)))
