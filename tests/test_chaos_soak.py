"""`make chaos` must keep working: 20 s of its soak (benchmarks/chaos.py) with a fixed
seed, in a subprocess, at world_size 2 in each scenario, must end by itself, print its
table and verdict, leave nothing behind and exit 0.

It checks every answer exactly: it found wrong stream items before issue 30's item 0
(a rank that raised moved on to the call queued behind, whose all_reduce paired with its
peers'); it must find none now.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SEED = 20240530


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_twenty_seconds_of_make_chaos() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.chaos", "--seconds", "20", "--seed", str(SEED),
         "--world-sizes", "2", "--lifetime", "7"],
        cwd=REPO, capture_output=True, text=True, timeout=280)
    out = proc.stdout
    shown = out[-6000:] + proc.stderr[-3000:]
    assert f"chaos: seed {SEED}" in out, shown
    assert re.search(r"^calls made +\d+", out, re.MULTILINE), shown  # the table
    assert "leftovers after shutdown" in out, shown
    verdict = re.search(r"^chaos: (PASS|FAIL): (\d+) wrong results or items, (\d+) "
                        r"leftovers, (\d+) unexpected", out, re.MULTILINE)
    assert verdict, shown
    assert proc.returncode == 0, shown
    assert verdict[1] == "PASS", shown
