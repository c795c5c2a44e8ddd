"""The table, as fixed-width text for the terminal and as markdown for the results file
and the Performance page (docs/performance.md), from the same cells so the two never disagree."""

from __future__ import annotations

from collections.abc import Sequence

from benchmarks.implementations.pools import JSON, MPQ
from benchmarks.report.results import Row

SCALE = {"us": (1e6, "µs", 0), "ms": (1e3, "ms", 2), "s": (1.0, "s", 2)}

HEADER = ("case", "ours median", "p10–p90", "p99", "floor", "ours ÷ floor",
          JSON, MPQ, f"speed-up vs {JSON}", f"speed-up vs {MPQ}", "target", "met")


def fmt(seconds: float | None, unit: str, *, with_unit: bool = True) -> str:
    if seconds is None:
        return "—"
    scale, name, digits = SCALE[unit]
    v = seconds * scale
    if unit == "ms" and v < 1:
        digits = 3
    return f"{v:.{digits}f} {name}" if with_unit else f"{v:.{digits}f}"


def _ratio(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}×"


def _met(m: bool | None, target: str) -> str:
    if not target or m is None:
        return ""
    return "yes" if m else "NO"


def cells(row: Row) -> list[str]:
    o = row.ours
    spread = "—" if o is None else f"{fmt(o.p10, row.unit, with_unit=False)}–{fmt(o.p90, row.unit)}"
    return [
        row.case,
        fmt(o.median if o else None, row.unit),
        spread,
        fmt(o.p99 if o else None, row.unit),
        fmt(row.floor.median if row.floor else None, row.unit),
        _ratio(row.over_floor),
        fmt(row.baselines[JSON].median if row.baselines.get(JSON) else None, row.unit),
        fmt(row.baselines[MPQ].median if row.baselines.get(MPQ) else None, row.unit),
        _ratio(row.speedup(JSON)),
        _ratio(row.speedup(MPQ)),
        row.target,
        _met(row.met, row.target),
    ]


def _sections(rows: Sequence[Row]) -> list[tuple[str, list[Row]]]:
    out: list[tuple[str, list[Row]]] = []
    for r in rows:
        if not out or out[-1][0] != r.section:
            out.append((r.section, []))
        out[-1][1].append(r)
    return out


def text_table(rows: Sequence[Row]) -> str:
    body = [cells(r) for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in body)) for i, h in enumerate(HEADER)]

    def line(cs: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cs, widths, strict=True))).rstrip()

    out = [line(HEADER), "-" * len(line(HEADER))]
    for section, rs in _sections(rows):
        out.append(f"[{section}]")
        out += [line(cells(r)) for r in rs]
    return "\n".join(out)


def markdown_table(rows: Sequence[Row]) -> str:
    out = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for section, rs in _sections(rows):
        out.append(f"| **{section}** |" + " |" * (len(HEADER) - 1))
        out += ["| " + " | ".join(cells(r)) + " |" for r in rs]
    return "\n".join(out)


def floors_legend(rows: Sequence[Row]) -> list[str]:
    seen: dict[str, None] = {}
    for r in rows:
        if r.floor_label:
            seen.setdefault(f"{r.section}: {r.floor_label}", None)
    return list(seen)
