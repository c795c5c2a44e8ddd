"""The README's quickstart runs as printed."""

from __future__ import annotations

import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_blocks(heading: str) -> list[str]:
    with open(os.path.join(REPO, "README.md")) as f:
        text = f.read()
    section = text.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def run_block(tmp_path, code: str) -> str:
    (tmp_path / "example.py").write_text(code)
    out = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=180, env=dict(os.environ, PYTHONPATH=REPO))
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_quickstart_runs_as_printed(tmp_path):
    (block,) = readme_blocks("Quickstart")
    assert run_block(tmp_path, block) == "2.0"


def test_bring_your_own_model_examples_run_as_printed(tmp_path):
    torchrun_style, runner_group = readme_blocks("Bring your own model")
    assert run_block(tmp_path, torchrun_style) == "3.0"
    assert run_block(tmp_path, runner_group) == "56.0"


def test_streaming_example_runs_as_printed(tmp_path):
    (block,) = readme_blocks("Streaming")
    assert run_block(tmp_path, block).splitlines() == [
        "(2, 8, 8, 3) 0", "(2, 8, 8, 3) 2", "(2, 8, 8, 3) 4", "3"]


def test_recovering_from_a_fault_example_runs_as_printed(tmp_path):
    (block,) = readme_blocks("Recovering from a fault")
    assert run_block(tmp_path, block).splitlines() == [
        "('a', 1)", "the session lost its state; tell the user, carry on", "('b', 1) 1"]


def test_pipelining_example_runs_as_printed(tmp_path):
    (block,) = readme_blocks("Pipelining")
    assert run_block(tmp_path, block).splitlines() == [
        "chunk 0 chunk 1", "chunk 2", "chunk 3", "chunk 4 True"]


def test_asyncio_example_runs_as_printed(tmp_path):
    (block,) = readme_blocks("asyncio")
    assert run_block(tmp_path, block).splitlines() == ["[0, 2, 4]", "42"]


def test_seeing_inside_a_step_example_runs_as_printed(tmp_path):
    block, = readme_blocks("Seeing inside a step")
    lines = run_block(tmp_path, block).splitlines()
    assert lines[:2] == ["1 True True", "3 [3, 3]"]
    assert lines[2].split() == ["count", "p50", "ms", "p90", "ms", "p99", "ms"]
    assert [line.split()[0] for line in lines[3:]] == ["rank", "rank", "overhead", "wall"]


def test_metrics_example_runs_as_printed(tmp_path):
    import pytest

    pytest.importorskip("prometheus_client")
    block = readme_blocks("Metrics and traces")[0]  # the Prometheus one (then the traces')
    assert run_block(tmp_path, block) == (
        """['reactor_dist_calls_total{method="generate",outcome="ok",runner="Double"} 3.0']""")
