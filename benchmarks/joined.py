"""``python -m benchmarks.joined [--trials N]``: ``make bench``'s rows of joined ranks'
faults alone (benchmarks/families/joined.py): a rank, its joiner SIGKILLed or
SIGSTOPped -> the runner knows; the application SIGKILLed -> every joined rank gone."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from benchmarks.config import FULL
from benchmarks.families import joined
from benchmarks.report import tables
from benchmarks.report.results import Results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.joined",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=FULL.joined_trials)
    args = ap.parse_args(argv)
    settings = dataclasses.replace(FULL, joined_trials=args.trials)
    results = Results()
    joined.measure(settings, results)
    print(tables.text_table(joined.rows(results, settings)))
    for note in results.notes:
        print("problem:", note)
    return 1 if results.notes else 0


if __name__ == "__main__":
    sys.exit(main())
