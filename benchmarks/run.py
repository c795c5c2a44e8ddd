"""``python -m benchmarks.run [--quick] [--out DIR]``: run every family, print the table,
write ``<out>/<date>-<host>.md`` and PNG plots beside it.

A full run into the default directory also rewrites the tables of the site's Performance
page, docs/performance.md (between ``<!-- bench:start -->`` and ``<!-- bench:end -->``),
and ``docs/bench_overview.png`` (the plot that page shows), so both always come from one
run on one machine. A quick run, or a run with ``--out``, leaves them alone. README.md's
headline numbers are static text.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shutil
import sys
import time
import traceback
from pathlib import Path

from benchmarks.config import FULL, QUICK, Settings
from benchmarks.families import FAMILIES
from benchmarks.report import hygiene, machine, readme, tables
from benchmarks.report.results import Results, Row

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results"
PERFORMANCE_PAGE = HERE.parent / "docs" / "performance.md"
DOCS_PLOT = HERE.parent / "docs" / "bench_overview.png"


def collect_rows(r: Results, s: Settings) -> list[Row]:
    return [row for _, family in FAMILIES for row in family.rows(r, s)]


def markdown(rows: list[Row], r: Results, s: Settings, *, stem: str, when: str,
             plots: list[Path], wall_s: float, problems: list[str], load: str) -> str:
    mode = "quick (`make bench-quick`)" if s.quick else "full (`make bench`)"
    out = [
        f"# reactor_dist benchmarks: {stem}",
        "",
        f"Run {when}, {mode}, {wall_s:.0f} s, {load}. Machine: {machine.describe()}.",
        "",
        "Medians over repeated trials; spread p10–p90 and p99 of the same trials. "
        "Speed-up = baseline median ÷ ours (below 1× the baseline is faster). "
        "Floors measured in the same run:",
        "",
        *[f"- {f}" for f in tables.floors_legend(rows)],
        "",
        tables.markdown_table(rows),
        "",
        "Baselines: `json-subprocess` is a subprocess per rank with a JSON request/reply "
        "loop over stdin/stdout and arrays through temporary `.npy` files; `mp-queue` is a "
        "multiprocessing spawn pool with one Queue per rank each way and pickled payloads "
        "(`benchmarks/baselines/`). They have no `shared_empty`: its rows compare against "
        "their plain-array result. Ratio targets are set on the 97 MB video step.",
        "",
    ]
    if r.notes or problems:
        out += ["## Problems in this run", ""] + [f"- {n}" for n in r.notes + problems] + [""]
    else:
        out += ["No /dev/shm entry, temporary directory or process outlived the run.", ""]
    out += [f"![{p.stem}]({p.name})" for p in plots]
    return "\n".join(out) + "\n"


def readme_section(rows: list[Row], *, when: str, plot: str, wall_s: float,
                   load: str) -> str:
    """What goes between the Performance page's markers (its headings stay)."""
    return "\n".join([
        f"Measured by `make bench` on {when}: {machine.describe()}; {load}. "
        "Each figure is the median over repeated trials (spread in the results file), "
        "next to this machine's floor measured in the same run and two baselines a user "
        "would otherwise write: `json-subprocess` (a subprocess per rank, JSON over "
        "stdin/stdout, frames through temporary `.npy` files) and `mp-queue` (a "
        "multiprocessing spawn pool with a Queue per rank and pickled payloads). "
        "Speed-up = baseline median ÷ ours (below 1× the baseline is faster).",
        "",
        tables.markdown_table(rows),
        "",
        f"![benchmarks]({plot})",
        "",
        f"Reproduce with `make bench` ({wall_s:.0f} s here) or `make bench-quick` "
        "(under one); results and plots land in `benchmarks/results/`.",
        "",
    ])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer trials: under a minute")
    ap.add_argument("--out", type=Path, default=None,
                    help=f"directory for the .md and .png files (default {DEFAULT_OUT})")
    args = ap.parse_args(argv)
    s = QUICK if args.quick else FULL
    out_dir: Path = args.out or DEFAULT_OUT
    out_dir.mkdir(parents=True, exist_ok=True)

    load_before = os.getloadavg()[0]
    before = hygiene.snapshot()
    now = dt.datetime.now()
    t0 = time.perf_counter()
    r = Results()
    for name, family in FAMILIES:
        print(f"[bench] {name} ...", file=sys.stderr, flush=True)
        t_family = time.perf_counter()
        try:
            family.measure(s, r)
        except Exception as exc:  # report it and go on: the other families still count
            traceback.print_exc()
            r.notes.append(f"{name} failed: {exc!r}")
        print(f"[bench] {name}: {time.perf_counter() - t_family:.0f} s", file=sys.stderr,
              flush=True)
    problems = hygiene.check(before)
    wall = time.perf_counter() - t0
    load_after = os.getloadavg()[0]
    load = f"1-minute load average {load_before:.1f} at the start, {load_after:.1f} at the end"
    # Only the start tells: by the end the load average counts the bench's own ranks.
    busy = load_before > (os.cpu_count() or 1) * 0.75
    if busy:
        load += " (other work shared the cores: figures are inflated)"
        print(f"[bench] warning: {load}", file=sys.stderr)

    rows = collect_rows(r, s)
    print(tables.text_table(rows))
    for line in r.notes + problems:
        print(f"PROBLEM: {line}")

    from benchmarks.report import plots  # matplotlib only once there is something to draw

    stem = f"{now:%Y-%m-%d}-{machine.host()}" + ("-quick" if s.quick else "")
    pngs = plots.write_all(r, s, out_dir, stem)
    when = f"{now:%Y-%m-%d %H:%M}"
    md = out_dir / f"{stem}.md"
    md.write_text(markdown(rows, r, s, stem=stem, when=when, plots=pngs, wall_s=wall,
                           problems=problems, load=load))
    print(f"\nwrote {md} and {len(pngs)} plots in {wall:.0f} s", file=sys.stderr)
    if args.out is None and not s.quick:
        DOCS_PLOT.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(pngs[0], DOCS_PLOT)
        plot_ref = DOCS_PLOT.name  # beside docs/performance.md
        readme.update(PERFORMANCE_PAGE, readme_section(rows, when=when, plot=plot_ref,
                                                       wall_s=wall, load=load))
        print(f"wrote {PERFORMANCE_PAGE}'s tables and {DOCS_PLOT}", file=sys.stderr)
    return 1 if (r.notes or problems) else 0


if __name__ == "__main__":
    sys.exit(main())
