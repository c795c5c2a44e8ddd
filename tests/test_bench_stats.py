"""The bench's same-run comparisons (benchmarks/report/stats.py): pairs of one call of
each kind, in an order drawn per pair, and the median of the pairs' differences."""

from __future__ import annotations

from benchmarks.report.stats import median_pair_difference, paired_calls, summarize


def test_paired_calls_runs_one_of_each_per_pair_in_a_drawn_order():
    ran: list[str] = []
    samples = paired_calls({"on": lambda: ran.append("on"), "off": lambda: ran.append("off")},
                           calls=200, warmup=3, seed=7)
    assert ran[:6] == ["on", "off"] * 3  # the warm-up, untimed
    pairs = [tuple(ran[i:i + 2]) for i in range(6, len(ran), 2)]
    assert len(pairs) == 200 and all(sorted(p) == ["off", "on"] for p in pairs)
    firsts = [p[0] for p in pairs]
    assert 70 < firsts.count("on") < 130  # drawn, not a fixed pattern
    assert firsts != ["on", "off"] * 100 and firsts != ["on", "off", "off", "on"] * 50
    assert [len(samples["on"]), len(samples["off"])] == [200, 200]
    again: list[str] = []
    paired_calls({"on": lambda: again.append("on"), "off": lambda: again.append("off")},
                 calls=200, warmup=3, seed=7)
    assert again == ran  # seeded


def test_the_median_pair_difference_cancels_what_both_of_a_pair_share():
    # each pair shares a slow or fast phase (2 or 4 ms); "on" costs 10 µs more
    base = [0.002 if (i // 50) % 2 else 0.004 for i in range(400)]
    on = summarize([b + 10e-6 for b in base])
    off = summarize(base)
    assert abs(median_pair_difference(on, off) - 10e-6) < 1e-12
