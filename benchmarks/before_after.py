"""``python -m benchmarks.before_after REV [--blocks N] [--module benchmarks.per_call |
--family NAME]``: one benchmark of this checkout against the same benchmark at git
revision ``REV``, in alternating blocks of the same run.

Two versions of reactor_dist cannot live in one process, so each block is a subprocess
run from a checkout: this one, and a temporary ``git worktree`` of ``REV`` (removed at
the end).  The blocks alternate (the order flipping each round), so drift in the
machine's load hits both alike.  For ``benchmarks.per_call`` each block prints ours and
the bare pyzmq floor measured together; the ratio ours ÷ floor is what compares best
across blocks.  ``--family NAME`` runs one family of ``make bench`` (``--quick``) with
this checkout's driver (benchmarks/family.py) over each tree's own family code and
package, and prints each block's table rows.  Prints each block's lines and the
medians; asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
RATIO = re.compile(r"ours ÷ floor ([0-9.]+)×")
OURS = re.compile(r"^ours\s+([0-9.]+)", re.M)


def block(tree: Path, module: str, args: list[str], family: str | None = None) -> str:
    command = [str(HERE / "benchmarks" / "family.py"), family, "--quick"] if family \
        else ["-m", module, *args]
    out = subprocess.run([sys.executable, *command], cwd=tree, text=True,
                         capture_output=True, timeout=900,
                         env={**os.environ, "PYTHONPATH": str(tree)})
    return out.stdout + (out.stderr[-2000:] if out.returncode else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.before_after",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("rev", help="the git revision to compare with (e.g. a commit before)")
    ap.add_argument("--blocks", type=int, default=6, help="blocks of each, alternating")
    ap.add_argument("--module", default="benchmarks.per_call")
    ap.add_argument("--family", default=None,
                    help="a family of make bench instead (pipelined, streaming, startup...)")
    ap.add_argument("args", nargs="*", default=["--trials", "1", "--rounds", "4",
                                                "--calls", "1500"])
    opts = ap.parse_args(argv)
    ratios: dict[str, list[float]] = {"before": [], "after": []}
    medians: dict[str, list[float]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory(prefix="rd-before-") as tmp:
        before = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(before), opts.rev],
                       cwd=HERE, check=True)
        try:
            for i in range(opts.blocks):
                order = [("before", before), ("after", HERE)]
                for name, tree in order if i % 2 == 0 else order[::-1]:
                    text = block(tree, opts.module, opts.args, opts.family)
                    if opts.family:
                        print(f"block {i + 1} {name}:\n{text.rstrip()}", flush=True)
                        continue
                    ratios[name] += [float(x) for x in RATIO.findall(text)[:1]]
                    medians[name] += [float(x) for x in OURS.findall(text)[:1]]
                    print(f"block {i + 1} {name}: " + " | ".join(
                        line.strip() for line in text.splitlines()
                        if line.startswith(("trial", "ours", "floor"))), flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(before)], cwd=HERE)
    for name in ("before", "after"):
        if ratios[name] and medians[name]:
            print(f"{name} ({opts.rev if name == 'before' else 'this checkout'}): median "
                  f"ours {statistics.median(medians[name]):.0f} µs per call, ours ÷ floor "
                  f"{statistics.median(ratios[name]):.2f}× over {len(ratios[name])} blocks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
