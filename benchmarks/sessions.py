"""``python -m benchmarks.sessions [--trials N]``: ``make bench``'s session rows alone
(benchmarks/families/sessions.py): what a snapshot costs a step (64 MB of state, K = 1
and 8, against a memcpy), and a fault the caller never sees (world_size 4, a spare,
K = 8, retry_failed), from the kill to the call's result."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from benchmarks.config import FULL
from benchmarks.families import sessions
from benchmarks.report import tables
from benchmarks.report.results import Results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.sessions",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=FULL.recovery_trials)
    ap.add_argument("--markdown", action="store_true",
                    help="the rows as docs/performance.md's table has them")
    args = ap.parse_args(argv)
    settings = dataclasses.replace(FULL, recovery_trials=args.trials)
    results = Results()
    sessions.measure(settings, results)
    rows = sessions.rows(results, settings)
    print(tables.markdown_table(rows) if args.markdown else tables.text_table(rows))
    for note in results.notes:
        print("problem:", note)
    return 1 if results.notes else 0


if __name__ == "__main__":
    sys.exit(main())
