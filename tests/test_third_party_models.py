"""Real third-party parallel models in the ranks (issue 33): transformers' own tensor
parallelism (a tiny Llama) and diffusers' own context parallelism (a tiny Wan
transformer, Ulysses), each at world_size 2 against world_size 1 in this process, each
rank holding its half, and each through a real fault and ``restart()`` with
``rejoin()``.  Nothing is downloaded: tiny configs, seeded random weights.  Slow (each
runner imports transformers or diffusers: ~5 s to start on two cores): make test-slow.
The docs' recipes for both are commands (``python -m workers.hf_llama``, issue 46), run
here as printed."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest
from docs_pages import REPO, blocks, examples
from test_docs_examples import marked

from reactor_dist import DistributedRunner, WorkerCrashed
from workers.hf_llama import TOKENS, TOLERANCE, LlamaTP, load_llama, logits, save_tiny_llama
from workers.wan_context import STEP, WanContextParallel, build_wan, predict

pytestmark = pytest.mark.slow
PAGE = "docs/bring-your-own-model.md"
# The recipes' one line of output: the value varies, its form and bound do not.
DIFFERENCE = re.compile(rf"max \|ws2 - ws1\| = (\d\.\de[+-]\d\d) \(within {TOLERANCE:.0e}\)")


def kill_and_restart(runner: DistributedRunner, rank: int) -> None:
    os.kill(runner.ranks[rank].pid, signal.SIGKILL)
    with pytest.raises(WorkerCrashed):
        runner.generate(1)  # noticed (a rank died while idle)
    runner.restart()


def test_transformers_tensor_parallel_llama_matches_world_size_1_and_survives_a_fault(
        tmp_path):
    path = save_tiny_llama(str(tmp_path / "llama"), seed=0)
    ids = TOKENS
    expected = logits(load_llama(path, None, "cpu"), ids, "cpu")
    with DistributedRunner(LlamaTP, world_size=2, device="cpu", load_kwargs={"path": path},
                           start_timeout=300, shutdown_grace=1.0) as runner:
        got = runner.generate(ids)
        assert got.shape == (32, 256)
        assert float(np.abs(got - expected).max()) <= TOLERANCE
        assert runner.generate("shards") == [(48, 96), (48, 96)]  # half of q_proj each
        survivor = runner.ranks[0].pid
        kill_and_restart(runner, 1)
        assert runner.ranks[0].pid == survivor  # kept its process: rejoin() resharded
        assert float(np.abs(runner.generate(ids) - expected).max()) <= TOLERANCE
        assert runner.generate("shards") == [(48, 96), (48, 96)]


def test_diffusers_context_parallel_wan_matches_world_size_1_and_survives_a_fault():
    expected = predict(build_wan(0), STEP, "cpu")
    with DistributedRunner(WanContextParallel, world_size=2, device="cpu",
                           start_timeout=300, shutdown_grace=1.0) as runner:
        got = runner.generate(STEP)
        assert got.shape == (1, 4, 3, 16, 16)
        assert float(np.abs(got - expected).max()) <= TOLERANCE
        assert runner.generate(-STEP) == [96, 96]  # half of the 192 tokens each
        survivor = runner.ranks[1].pid
        kill_and_restart(runner, 0)
        assert runner.ranks[1].pid == survivor
        assert float(np.abs(runner.generate(STEP) - expected).max()) <= TOLERANCE
        assert runner.generate(-STEP) == [96, 96]


def run_recipe_as_printed(heading: str) -> None:
    """The page's command under ``heading`` run as printed: by bash, from the checkout,
    this venv's python first on PATH (as an activated venv has it), no PYTHONPATH. Its
    one line of output and the page's shown output have the form and bound of
    DIFFERENCE, and every process it started has ended."""
    (command,) = examples(PAGE, heading)
    (shown,) = [b.code for b in blocks(PAGE) if b.heading == heading and b.language == "text"]
    mark = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""),
               REACTOR_DIST_DOCS_EXAMPLE=mark)
    out = subprocess.run(["bash", "-e", "-c", command], cwd=REPO, env=env, text=True,
                         capture_output=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr  # 1: over the bound
    for text in (out.stdout, shown):
        (line,) = text.splitlines()
        match = DIFFERENCE.fullmatch(line)
        assert match, line
        assert float(match.group(1)) <= TOLERANCE
    deadline = time.monotonic() + 10  # the ranks end with their runners' shutdown
    while marked(mark) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert marked(mark) == []


@pytest.mark.timeout(300)
def test_transformers_recipe_runs_as_printed():
    run_recipe_as_printed("transformers' tensor parallelism (`workers/hf_llama.py`)")


@pytest.mark.timeout(300)
def test_diffusers_recipe_runs_as_printed():
    run_recipe_as_printed("diffusers' context parallelism (`workers/wan_context.py`)")
