"""What a run measured (raw trials by key) and the rows the report prints from it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from benchmarks.report.stats import Stats, interleave, median_pair_difference

FLOOR = "floor"


@dataclass
class Results:
    """Trials keyed by (metric, configuration, implementation); the families fill it,
    the report and plots read it."""

    stats: dict[tuple[str, str, str], Stats] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def put(self, metric: str, config: str, impl: str, stats: Stats) -> None:
        self.stats[(metric, config, impl)] = stats

    def get(self, metric: str, config: str, impl: str) -> Stats | None:
        return self.stats.get((metric, config, impl))

    def measure(self, metric: str, config: str, fns: dict[str, Callable[[], object]],
                n: dict[str, int], warmup: dict[str, int], rounds: int) -> None:
        """Time ``fns`` (implementation -> one call) interleaved and keep their trials;
        one that fails is noted and left out, the others still count."""

        def failed(impl: str, exc: BaseException) -> None:
            self.notes.append(f"{impl}: {metric} {config} failed: {exc!r}")

        for impl, st in interleave(fns, n, warmup=warmup, rounds=rounds,
                                   failed=failed).items():
            self.put(metric, config, impl, st)


@dataclass
class Row:
    """One line of the table: ours next to its floor and the baselines, with the target."""

    section: str
    case: str
    unit: str  # "us", "ms" or "s": how the row's seconds are printed
    ours: Stats | None
    floor: Stats | None = None
    floor_label: str = ""
    baselines: dict[str, Stats | None] = field(default_factory=dict)
    target: str = ""
    met: bool | None = None

    @property
    def over_floor(self) -> float | None:
        if self.ours is None or self.floor is None or self.floor.median <= 0:
            return None
        return self.ours.median / self.floor.median

    def speedup(self, baseline: str) -> float | None:
        b = self.baselines.get(baseline)
        if self.ours is None or b is None or self.ours.median <= 0:
            return None
        return b.median / self.ours.median


def extra_row(section: str, case: str, ours: Stats | None, without: Stats | None,
              floor_label: str, target_s: float, *, paired: bool = False) -> Row:
    """A row for what one feature adds per call: ``ours`` against the same runner
    ``without`` it, judged against ``target_s`` seconds more: the difference of the
    medians, or with ``paired`` (samples taken by stats.paired_calls) the median pair's
    difference (stats.median_pair_difference)."""
    goal = f"≤ +{target_s * 1e6:g} µs"
    row = Row(section=section, case=case, unit="us", ours=ours, floor=without,
              floor_label=floor_label, target=goal)
    if ours is not None and without is not None:
        extra = median_pair_difference(ours, without) if paired else \
            ours.median - without.median
        row.target = f"{goal} ({extra * 1e6:+.1f} µs{', the median pair' if paired else ''})"
        row.met = extra <= target_s
    return row
