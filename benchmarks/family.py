"""``python -m benchmarks.family NAME [--quick]``: one family of ``make bench``
(``benchmarks/families/NAME.py``: pipelined, streaming, startup, ...) alone; prints its
rows as the bench's table does, writes nothing.  ``benchmarks.before_after --family NAME``
runs it against an earlier revision in alternating blocks."""

from __future__ import annotations

import argparse
import importlib
import sys

from benchmarks.config import FULL, QUICK
from benchmarks.report import tables
from benchmarks.report.results import Results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.family",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("name", help="a module of benchmarks/families")
    ap.add_argument("--quick", action="store_true", help="fewer trials, as bench-quick")
    args = ap.parse_args(argv)
    family = importlib.import_module(f"benchmarks.families.{args.name}")
    s = QUICK if args.quick else FULL
    r = Results()
    family.measure(s, r)
    print(tables.text_table(family.rows(r, s)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
