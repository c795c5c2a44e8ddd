"""`make chaos` must keep working: 20 s of its soak (benchmarks/chaos.py) with a fixed
seed, in a subprocess, at world_size 2 in each scenario, must end by itself, print its
table and verdict, leave nothing behind and exit 0.

On today's main it does not always exit 0, for a bug it reproduces: a stream hands out
wrong items when one rank leaves a call early (it raised) while another call is queued
behind (issue 30, item 0).  Reproduced with ``python -m benchmarks.chaos --seconds 20
--scenarios stream --world-sizes 2 --faults raise_one --fault-every 1,2``: 4 of 4 runs
(seeds 3-6) had 1-4 wrong items, e.g. ``item 1 ([1713748385861.0, 2193.0, 1.0]) came
although the fault fires at item 0 after_collective``; by hand it is certain (rank 1
raises before item 1's all_reduce of a 4-item stream with a submit() behind: item 1 is
wrong, the submitted call's all_reduce paired with it).  Whether a 20 s run hits it
depends on timing, so the test cannot fail every time on it (a strict xfail would fail
whenever it is missed); the xfail is therefore limited to that failure alone
(``raises=``): wrong stream items and nothing else.  Any other failure (a wrong result
of a plain call, a stuck call, leftovers, no table) fails the test.  Once item 0 is
fixed the test passes (XPASS): remove the mark then.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SEED = 20240530


class WrongStreamItems(AssertionError):
    """The soak's only failure was wrong stream items: issue 30's item 0."""


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.xfail(raises=WrongStreamItems, strict=False,
                   reason="issue 30 item 0: a stream hands out wrong items when one rank "
                          "raises while a call is queued behind (reproduced; not every run)")
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
    wrong = [line for line in out.splitlines() if line.startswith("WRONG ")]
    if proc.returncode == 1 and verdict[3] == "0" and "; stuck" not in out and wrong and \
            all(re.search(r": item \d+ ", line) for line in wrong):
        raise WrongStreamItems("\n".join(wrong))
    assert proc.returncode == 0, shown
    assert verdict[1] == "PASS", shown
