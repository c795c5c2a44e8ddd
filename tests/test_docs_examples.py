"""Every code block on every page (README.md and docs/**/*.md) either runs in the tests
as printed, with its exact output checked, or is marked as a fragment.

The rule: a block fenced as python, bash, sh, shell or console is an example. Each
example sits under a heading named in EXAMPLES below (page, heading -> how many examples,
the test that runs them as printed), or is preceded by the line ``<!-- fragment -->``.
Output is fenced as ``text`` and is no example; a fence without a language fails.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
import uuid

import psutil
import pytest
from docs_pages import EXAMPLE_LANGUAGES, REPO, blocks, examples, pages, run_block

# (page, heading) -> (number of examples there, "file::test" that runs each as printed)
EXAMPLES = {
    ("README.md", "Quickstart"):
        (1, "test_docs_examples.py::test_readme_quickstart_is_the_sites_as_printed"),
    ("docs/index.md", "Your first runner"):
        (1, "test_docs_examples.py::test_quickstart_runs_as_printed"),
    ("docs/bring-your-own-model.md", "A torchrun-style model that forms its own torch group"):
        (1, "test_docs_examples.py::test_bring_your_own_model_examples_run_as_printed"),
    ("docs/bring-your-own-model.md", "A model that uses the runner's torch group"):
        (1, "test_docs_examples.py::test_bring_your_own_model_examples_run_as_printed"),
    ("docs/bring-your-own-model.md", "torch's own `parallelize_module` and "
                                    "`torch.distributed.device_mesh.DeviceMesh`"):
        (1, "test_docs_examples.py::test_parallelize_module_recipe_runs_as_printed"),
    ("docs/bring-your-own-model.md", "transformers' tensor parallelism (`workers/hf_llama.py`)"):
        (1, "test_third_party_models.py::test_transformers_recipe_runs_as_printed"),
    ("docs/bring-your-own-model.md", "diffusers' context parallelism (`workers/wan_context.py`)"):
        (1, "test_third_party_models.py::test_diffusers_recipe_runs_as_printed"),
    ("docs/bring-your-own-model.md", "Calling your own methods on every rank"):
        (1, "test_docs_examples.py::test_calling_methods_by_name_example_runs_as_printed"),
    ("docs/bring-your-own-model.md", "Binding each rank to its GPU's NUMA node"):
        (1, "test_numa.py::test_the_docs_numa_launch_prefix_binds_each_rank"),
    ("docs/streaming.md", "A generator worker"):
        (1, "test_docs_examples.py::test_streaming_example_runs_as_printed"),
    ("docs/pipelining-and-asyncio.md", "Pipelining"):
        (1, "test_docs_examples.py::test_pipelining_example_runs_as_printed"),
    ("docs/pipelining-and-asyncio.md", "asyncio"):
        (1, "test_docs_examples.py::test_asyncio_example_runs_as_printed"),
    ("docs/errors-and-recovery.md", "Recovering from a fault"):
        (1, "test_docs_examples.py::test_recovering_from_a_fault_example_runs_as_printed"),
    ("docs/errors-and-recovery.md", "Sessions that survive a fault: snapshots, replay, "
                                    "retried calls"):
        (1, "test_docs_examples.py::test_sessions_example_runs_as_printed"),
    ("docs/more-than-one-machine.md", "Placing the ranks"):
        (1, "test_ray.py::test_more_than_one_machine_example_runs_as_printed"),
    ("docs/more-than-one-machine.md", "Trying it on one machine"):
        (1, "test_docs_examples.py::test_two_node_try_on_one_machine_runs_as_printed"),
    ("docs/seeing-inside-a-step.md", "Timings"):
        (1, "test_docs_examples.py::test_seeing_inside_a_step_example_runs_as_printed"),
    ("docs/seeing-inside-a-step.md", "Metrics (Prometheus)"):
        (1, "test_docs_examples.py::test_metrics_example_runs_as_printed"),
    ("docs/seeing-inside-a-step.md", "Traces (OpenTelemetry)"):
        (1, "test_tracing.py::test_docs_traces_example_runs_as_printed"),
}


def test_every_example_on_every_page_runs_in_the_tests_or_is_a_fragment():
    found: dict[tuple[str, str], int] = {}
    problems = []
    for page in pages():
        for b in blocks(page):
            if b.language == "":
                problems.append(f"{page}:{b.line}: a fence without a language: fence output "
                                f"as ```text, an example as ```python (or bash)")
            elif b.language in EXAMPLE_LANGUAGES and not b.fragment:
                key = (page, b.heading)
                found[key] = found.get(key, 0) + 1
                if key not in EXAMPLES:
                    problems.append(f"{page}:{b.line}: a {b.language} block under "
                                    f"{b.heading!r} that no test runs: add it to EXAMPLES "
                                    f"with a test that runs it as printed, or put "
                                    f"'<!-- fragment -->' on the line before it")
    for key, (count, _) in EXAMPLES.items():
        if found.get(key, 0) != count:
            problems.append(f"{key}: EXAMPLES expects {count} example(s), the page has "
                            f"{found.get(key, 0)}")
    assert problems == []


def test_each_example_names_a_test_that_exists():
    for (page, heading), (_, where) in EXAMPLES.items():
        module, test = where.split("::")
        with open(os.path.join(REPO, "tests", module)) as f:
            assert re.search(rf"^def {test}\(", f.read(), re.M), (page, heading, where)


def test_the_rule_sees_an_unmarked_example_and_a_marked_fragment(tmp_path, monkeypatch):
    # The scanner itself, on a page made for it: what the rule rests on.
    import docs_pages

    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("# t\n\n## Run\n\n```python\nprint(1)\n```\n")
    (tmp_path / "docs" / "p.md").write_text(
        "# P\n\n## A {#a}\n\n<!-- fragment -->\n```python\nx\n```\n\n```text\nout\n```\n"
        "\n```\nbare\n```\n")
    monkeypatch.setattr(docs_pages, "REPO", str(tmp_path))
    assert [(b.page, b.heading, b.language, b.fragment) for p in docs_pages.pages()
            for b in docs_pages.blocks(p)] == [
        ("README.md", "Run", "python", False),
        ("docs/p.md", "A", "python", True),
        ("docs/p.md", "A", "text", False),
        ("docs/p.md", "A", "", False)]
    assert docs_pages.examples("README.md", "Run") == ["print(1)\n"]
    assert docs_pages.examples("docs/p.md", "A") == []


def test_readme_quickstart_is_the_sites_as_printed():
    # One run (test_quickstart_runs_as_printed) covers both: the two blocks are one text.
    assert examples("README.md", "Quickstart") == examples("docs/index.md", "Your first runner")


def test_quickstart_runs_as_printed(tmp_path):
    (block,) = examples("docs/index.md", "Your first runner")
    assert run_block(tmp_path, block) == "2.0"


def test_bring_your_own_model_examples_run_as_printed(tmp_path):
    page = "docs/bring-your-own-model.md"
    (torchrun_style,) = examples(page, "A torchrun-style model that forms its own torch group")
    (runner_group,) = examples(page, "A model that uses the runner's torch group")
    assert run_block(tmp_path, torchrun_style) == "3.0"
    assert run_block(tmp_path, runner_group) == "56.0"


def test_calling_methods_by_name_example_runs_as_printed(tmp_path):
    (block,) = examples("docs/bring-your-own-model.md", "Calling your own methods on every rank")
    assert run_block(tmp_path, block).splitlines() == [
        "rank 0: watercolor at 0.8", "['rank 0: ink at 1.0', 'rank 1: ink at 1.0']",
        "a cat in ink"]


def test_streaming_example_runs_as_printed(tmp_path):
    (block,) = examples("docs/streaming.md", "A generator worker")
    assert run_block(tmp_path, block).splitlines() == [
        "(2, 8, 8, 3) 0", "(2, 8, 8, 3) 2", "(2, 8, 8, 3) 4", "3"]


def test_recovering_from_a_fault_example_runs_as_printed(tmp_path):
    (block,) = examples("docs/errors-and-recovery.md", "Recovering from a fault")
    assert run_block(tmp_path, block).splitlines() == [
        "('a', 1)", "rank 1 exited with code 1 in generate() (call 2): the session lost "
        "its state", "('b', 1) 1"]


def test_parallelize_module_recipe_runs_as_printed(tmp_path):
    (block,) = examples("docs/bring-your-own-model.md",
                        "torch's own `parallelize_module` and "
                                    "`torch.distributed.device_mesh.DeviceMesh`")
    assert run_block(tmp_path, block) == "True True"


def test_sessions_example_runs_as_printed(tmp_path):
    (block,) = examples("docs/errors-and-recovery.md", "Sessions that survive a fault: "
                        "snapshots, replay, retried calls")
    assert run_block(tmp_path, block).splitlines() == ["[1, 3, 6, 10] 1", "3 0 1 0"]


def test_pipelining_example_runs_as_printed(tmp_path):
    (block,) = examples("docs/pipelining-and-asyncio.md", "Pipelining")
    assert run_block(tmp_path, block).splitlines() == [
        "chunk 0 chunk 1", "chunk 2", "chunk 3", "chunk 4 True"]


def test_asyncio_example_runs_as_printed(tmp_path):
    (block,) = examples("docs/pipelining-and-asyncio.md", "asyncio")
    assert run_block(tmp_path, block).splitlines() == ["[0, 2, 4]", "42"]


def test_seeing_inside_a_step_example_runs_as_printed(tmp_path):
    (block,) = examples("docs/seeing-inside-a-step.md", "Timings")
    lines = run_block(tmp_path, block).splitlines()
    assert lines[:2] == ["1 True True", "3 [3, 3]"]
    assert lines[2].split() == ["count", "p50", "ms", "p90", "ms", "p99", "ms"]
    assert [line.split()[0] for line in lines[3:]] == ["rank", "rank", "overhead", "wall"]


def test_metrics_example_runs_as_printed(tmp_path):
    pytest.importorskip("prometheus_client")
    (block,) = examples("docs/seeing-inside-a-step.md", "Metrics (Prometheus)")
    assert run_block(tmp_path, block) == (
        """['reactor_dist_calls_total{method="generate",outcome="ok",runner="Double"} 3.0']""")


def marked(mark: str) -> list[int]:
    """The live processes whose environment carries ``mark`` (every process the example
    started, Ray's included, inherits it)."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("REACTOR_DIST_DOCS_EXAMPLE") == mark and \
                    p.status() != psutil.STATUS_ZOMBIE:
                found.append(p.pid)
        except (psutil.Error, OSError):
            pass
    return found


@pytest.mark.timeout(360)
@pytest.mark.alone  # with the Ray tests, one cluster at a time (tests/test_ray.py says why)
def test_two_node_try_on_one_machine_runs_as_printed(tmp_path):
    pytest.importorskip("ray", reason="the two-node try needs the ray extra (make test has it)")
    (block,) = examples("docs/more-than-one-machine.md", "Trying it on one machine")
    mark = uuid.uuid4().hex
    # As a user runs it: the script sets the two Ray variables itself.  Its Ray folders
    # go to a folder of the test's own (RAY_TMPDIR; short: Ray's socket paths are
    # bounded), removed after it, so nothing lands in /tmp/ray.
    temp_dir = tempfile.mkdtemp(prefix="rd-ray-", dir="/tmp")
    env = {"REACTOR_DIST_DOCS_EXAMPLE": mark, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "",
           "RAY_USAGE_STATS_ENABLED": "", "RAY_ADDRESS": "", "RAY_TMPDIR": temp_dir}
    before = os.listdir("/tmp/ray") if os.path.isdir("/tmp/ray") else []
    try:
        assert run_block(tmp_path, block, env=env, timeout=300).splitlines() == [
            "2 nodes", "3.0"]
        deadline = time.monotonic() + 15  # Ray's processes end just after the script
        while marked(mark) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert marked(mark) == []
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert (os.listdir("/tmp/ray") if os.path.isdir("/tmp/ray") else []) == before


def test_the_api_pages_show_the_docstrings_rest_roles_as_code():
    """docs/_hooks/roles.py (an MkDocs hook): ``:meth:`x``` is ``x`` on the site, as
    Sphinx shows it (``~a.b.C`` as ``C``), not the role's name as text."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "roles", os.path.join(REPO, "docs", "_hooks", "roles.py"))
    roles = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(roles)
    html = ("see :meth:<code>submit</code>, :class:<code>~reactor_dist.caller.stream.Stream"
            "</code> and :mod:<code>reactor_dist.placement</code>; a:b:<code>c</code> stays")
    assert roles.on_page_content(html) == (
        "see <code>submit</code>, <code>Stream</code> and <code>reactor_dist.placement</code>"
        "; a:b:<code>c</code> stays")
