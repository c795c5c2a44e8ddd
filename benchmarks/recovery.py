"""``python -m benchmarks.recovery [--trials N]``: ``make bench``'s recovery rows alone
(benchmarks/families/recovery.py): (a) a brand-new runner, (b) ``restart()``, (c)
``restart()`` with ``rejoin`` (also with the victim inside a collective), (d)
``restart()`` with a spare, from a rank's SIGKILL to the next answered call."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from benchmarks.config import FULL
from benchmarks.families import recovery
from benchmarks.report import tables
from benchmarks.report.results import Results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.recovery",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=FULL.recovery_trials)
    args = ap.parse_args(argv)
    settings = dataclasses.replace(FULL, recovery_trials=args.trials)
    results = Results()
    recovery.measure(settings, results)
    print(tables.text_table(recovery.rows(results, settings)))
    for note in results.notes:
        print("problem:", note)
    return 1 if results.notes else 0


if __name__ == "__main__":
    sys.exit(main())
