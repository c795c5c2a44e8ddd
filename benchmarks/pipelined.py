"""``python -m benchmarks.pipelined [--quick]``: the "pipelined steps" rows of ``make
bench`` alone (see ``benchmarks/families/pipelined.py``): steps per second of an app
whose rank computes C ms and which works W ms per step, one at a time and with the next
step submitted ahead, against the bound 1 / max(C, W). Prints the table; writes nothing."""

from __future__ import annotations

import argparse
import sys

from benchmarks.config import FULL, QUICK
from benchmarks.families import pipelined
from benchmarks.report import tables
from benchmarks.report.results import Results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.pipelined",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps, as bench-quick")
    args = ap.parse_args(argv)
    s = QUICK if args.quick else FULL
    r = Results()
    pipelined.measure(s, r)
    print(tables.text_table(pipelined.rows(r, s)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
