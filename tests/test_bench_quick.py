"""`make bench-quick` must keep working: it runs, cleans up after itself and writes its
results file and plots, and leaves docs/performance.md (the site's bench tables)
alone. Timings are not checked (benchmarks measure, never assert). Slow (a minute or
more on 2 cores): `make test-slow` runs it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from reactor_dist.shm import segments

REPO = Path(__file__).resolve().parents[1]


pytestmark = [pytest.mark.slow, pytest.mark.alone]  # benchmarks: the machine to themselves


@pytest.mark.timeout(240)
def test_quick_bench_runs_and_writes_results(tmp_path: Path) -> None:
    page_before = (REPO / "docs" / "performance.md").read_bytes()
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--quick", "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=230,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    mds = list(tmp_path.glob("*.md"))
    assert len(mds) == 1, list(tmp_path.iterdir())
    assert list(tmp_path.glob("*.png")), list(tmp_path.iterdir())
    text = mds[0].read_text()
    assert "generate(1), world_size 2" in text
    assert "the protocol alone, world_size 2" in text  # the protocol's floor beside it
    # The streaming and asyncio rows, each with its target judged (yes or NO).
    for case in ("stream(): time to first item, keep_free_segments=8",
                 "stream(): whole step, keep_free_segments=8",
                 "stream(): time to first item, default keep_free_segments=2",
                 "await runner.agenerate(1)", "async for over runner.astream(1), one item"):
        [line] = [ln for ln in text.splitlines() if ln.startswith(f"| {case} |")]
        if "first item" in case or "runner.a" in case:
            assert line.rstrip(" |").endswith(("| yes", "| NO")), line
    # The metrics-cost row (issue 22): registered vs not, its target judged.
    [line] = [ln for ln in text.splitlines()
              if ln.startswith("| generate(1), metrics registered vs not |")]
    assert line.rstrip(" |").endswith(("| yes", "| NO")), line
    # The pipelined-steps rows: with two in flight the goal is judged, the others inform.
    for cw in ("C=40 ms, W=10 ms", "C=20 ms, W=20 ms"):
        for loop in ("generate, then work", "submit ahead, max_in_flight=1",
                     "submit ahead, max_in_flight=2"):
            [line] = [ln for ln in text.splitlines() if ln.startswith(f"| {cw}: {loop} |")]
            judged = line.rstrip(" |").endswith(("| yes", "| NO"))
            assert judged == loop.endswith("=2"), line
    # The session rows (issue 32): each snapshot's cost judged against its floor.
    for ws in (1, 2):
        for k in (1, 8):
            [line] = [ln for ln in text.splitlines()
                      if ln.startswith(f"| world_size {ws}: a snapshot, snapshot_every={k} |")]
            assert line.rstrip(" |").endswith(("| yes", "| NO")), line
    assert any(ln.startswith("| kill -> the call's result (no error;") for ln in text.splitlines())
    # A fresh CPU buffer per call (issue 43): the ranks' default judged, the others inform.
    for case, judged in (("no setting (torch's and glibc's defaults)", False),
                         ("THP_MEM_ALLOC_ENABLE=1 (the ranks' default)", True),
                         ("in a rank (world_size 1), its default environment", True)):
        [line] = [ln for ln in text.splitlines() if ln.startswith(f"| {case} |")]
        assert line.rstrip(" |").endswith(("| yes", "| NO")) == judged, line
    assert "Problems in this run" not in text
    assert "generate(1), world_size 2" in proc.stdout  # the table reached stdout
    assert (REPO / "docs" / "performance.md").read_bytes() == page_before  # a full run writes it


@pytest.mark.timeout(120)
def test_the_plain_loop_harness_runs() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.per_call", "--calls", "200", "--warmup", "20",
         "--trials", "1", "--rounds", "2"],
        cwd=REPO, capture_output=True, text=True, timeout=110,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("runner.generate(1) vs bare pyzmq echo peers, world_size 2")
    assert lines[1].startswith("trial 1: ours ÷ floor ")
    assert [line.split()[0] for line in lines[3:5]] == ["ours", "floor"]


@pytest.mark.timeout(120)
def test_the_cpu_per_call_diagnostic_runs() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.cpu_per_call", "--calls", "300", "--trials", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=110,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("generate(1), world_size 2, 300 calls x 1 trials")
    assert [line.split()[0] for line in lines[2:]] == ["reactor_dist", "floor"]
    assert all(len(line.split()) == 4 for line in lines[2:])


@pytest.mark.timeout(120)
def test_the_ring_entry_cost_diagnostic_runs_and_leaves_nothing_in_dev_shm() -> None:
    before = set(os.listdir(segments.DEFAULT_DIR))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.ring_entry_cost", "--calls", "1000"],
                          cwd=REPO, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert [line.split(":")[0] for line in proc.stdout.splitlines()] == \
        ["an all_reduce's entry and its mark", "a call's begin"]
    assert [n for n in os.listdir(segments.DEFAULT_DIR)
            if n not in before and n.startswith("rd-ring-cost-")] == []


@pytest.mark.timeout(120)
def test_the_pipelined_steps_rows_run_alone() -> None:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.pipelined", "--quick"],
                          cwd=REPO, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    assert lines[2].startswith("[Pipelined steps (a rank computes C ms per step")
    cases = [line.split(":")[1].split("  ")[0].strip() for line in lines[3:]]
    assert cases == ["generate, then work", "submit ahead, max_in_flight=1",
                     "submit ahead, max_in_flight=2"] * 2
    assert [line.split(":")[0] for line in lines[3:]] == \
        ["C=40 ms, W=10 ms"] * 3 + ["C=20 ms, W=20 ms"] * 3
    assert [line.rstrip().endswith((" yes", " NO")) for line in lines[3:]] == \
        [False, False, True] * 2
