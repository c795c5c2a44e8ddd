"""PNG plots of a run (matplotlib, Agg): bars are medians, whiskers p10–p90, dots p99."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402

from benchmarks.config import Settings  # noqa: E402
from benchmarks.families import aio_calls, streaming, world_size  # noqa: E402
from benchmarks.families.frames import SHARED  # noqa: E402
from benchmarks.implementations.pools import JSON, MPQ, OURS  # noqa: E402
from benchmarks.report.results import FLOOR, Results  # noqa: E402
from benchmarks.report.stats import Stats  # noqa: E402

COLORS = {"floor": "#9e9e9e", OURS: "#1f77b4", SHARED: "#17becf",
          JSON: "#ff7f0e", MPQ: "#d62728"}


def _bars(ax: Axes, groups: Sequence[str], series: dict[str, Sequence[Stats | None]],
          scale: float, unit: str, *, log: bool = False) -> None:
    n = len(series)
    width = 0.8 / max(n, 1)
    for i, (name, values) in enumerate(series.items()):
        xs, ys, lo, hi, p99x, p99y = [], [], [], [], [], []
        for g, st in enumerate(values):
            if st is None:
                continue
            x = g - 0.4 + width * (i + 0.5)
            xs.append(x)
            ys.append(st.median * scale)
            lo.append((st.median - st.p10) * scale)
            hi.append((st.p90 - st.median) * scale)
            p99x.append(x)
            p99y.append(st.p99 * scale)
        if not xs:
            continue
        color = COLORS["floor"] if name.startswith("floor") else COLORS.get(name)
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=name, color=color,
               edgecolor="black", linewidth=0.4)
        ax.plot(p99x, p99y, ".", color="black", markersize=3)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, fontsize=8)
    ax.set_ylabel(unit)
    if log:
        ax.set_yscale("log")
    else:
        _clip_tails(ax, series, scale)
    ax.grid(axis="y", alpha=0.3, which="both")
    ax.legend(fontsize=7)


def _clip_tails(ax: Axes, series: dict[str, Sequence[Stats | None]], scale: float) -> None:
    """On a linear axis a single p99 outlier would flatten every bar: cap the axis at
    1.5× the highest p90 and print the clipped p99 values at the top instead."""
    top = 1.5 * max((st.p90 * scale for v in series.values() for st in v if st), default=0)
    if top <= 0:
        return
    ax.set_ylim(0, top)
    n = len(series)
    width = 0.8 / max(n, 1)
    for i, values in enumerate(series.values()):
        for g, st in enumerate(values):
            if st is not None and st.p99 * scale > top:
                x = g - 0.4 + width * (i + 0.5)
                ax.annotate(f"p99\n{st.p99 * scale:.0f}", (x, top), xytext=(0, -2),
                            textcoords="offset points", ha="center", va="top", fontsize=6)


def overhead_panel(ax: Axes, r: Results, s: Settings) -> None:
    groups = [f"world_size {ws}" for ws in s.world_sizes]
    impls = {"floor": FLOOR, OURS: OURS, JSON: JSON, MPQ: MPQ}
    _bars(ax, groups, {k: [r.get("call", f"ws{ws}", v) for ws in s.world_sizes]
                       for k, v in impls.items()}, 1e6, "µs per generate(1)")
    ax.set_title("Per-call overhead (floor: bare pyzmq echo peers)", fontsize=9)


def world_size_panel(ax: Axes, r: Results, s: Settings) -> None:
    """Cost against world size: ours and the bare bus, per call and the caller's CPU."""
    sizes = list(s.table_world_sizes)
    for metric, style, what in ((world_size.CALL, "-o", "per call"),
                                (world_size.CALLER, "--s", "caller's CPU")):
        for impl, name in ((OURS, OURS), (FLOOR, "bare bus")):
            points = [(ws, r.get(metric, f"ws{ws}", impl)) for ws in sizes]
            xs = [ws for ws, st in points if st is not None]
            ys = [st.median * 1e6 for _, st in points if st is not None]
            if xs:
                ax.plot(xs, ys, style, label=f"{name}, {what}",
                        color=COLORS["floor"] if impl == FLOOR else COLORS[OURS])
    ax.set_xticks(sizes)
    ax.set_xlabel("world_size")
    ax.set_ylabel("µs")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title("generate(1) against world size (bus: bare pyzmq peers)", fontsize=9)


def frames_panel(ax: Axes, r: Results, s: Settings) -> None:
    labels = [p.label for p in s.payloads]
    _bars(ax, labels, {
        "floor": [r.get("result", lb, FLOOR) for lb in labels],
        OURS: [r.get("result", lb, OURS) for lb in labels],
        SHARED: [r.get("result", lb, SHARED) for lb in labels],
        JSON: [r.get("result", lb, JSON) for lb in labels],
        MPQ: [r.get("result", lb, MPQ) for lb in labels],
    }, 1e3, "ms per step (log)", log=True)
    ax.set_title("Frames back, world_size 2 (floor: warm np.copyto)", fontsize=9)


def broadcast_panel(ax: Axes, r: Results, s: Settings) -> None:
    cfgs = [(p.label, f"{p.label} ws{ws}", f"{p.label} in\nws {ws}")
            for ws in s.sink_world_sizes for p in s.payloads]
    groups = [c[2] for c in cfgs] + [f"{p.label} in+echo\nws 2" for p in s.payloads]

    def pick(impl: str) -> list[Stats | None]:
        return ([r.get("input", c[1], impl) for c in cfgs]
                + [r.get("echo", p.label, impl) for p in s.payloads])

    floor = ([r.get("result", c[0], FLOOR) for c in cfgs]
             + [r.get("result", p.label, FLOOR) for p in s.payloads])
    _bars(ax, groups, {"floor": floor, OURS: pick(OURS), JSON: pick(JSON), MPQ: pick(MPQ)},
          1e3, "ms per step (log)", log=True)
    ax.set_title("Input broadcast and input + echo (floor: warm np.copyto)", fontsize=9)


def _label_medians(ax: Axes, values: Sequence[Stats | None], scale: float, unit: str) -> None:
    """Print each median above its bar (single-series panels, where bars are wide)."""
    for g, st in enumerate(values):
        if st is not None:
            ax.annotate(f"{st.median * scale:.3g} {unit}", (g, st.p90 * scale),
                        xytext=(0, 3), textcoords="offset points", ha="center", fontsize=8)


def failure_panel(ax: Axes, r: Results, s: Settings) -> None:
    groups = ["SIGKILL rank 0", "SIGKILL rank 1", f"hang, timeout {s.call_timeout_s:g} s"]
    ours = [r.get("crash", "rank0", OURS), r.get("crash", "rank1", OURS),
            r.get("timeout", "all", OURS)]
    _bars(ax, groups, {OURS: ours}, 1e3, "ms to the exception (log)", log=True)
    ax.axhline(100, color="green", linestyle="--", linewidth=0.8, label="crash target 100 ms")
    ax.axhline(s.call_timeout_s * 1e3, color="gray", linestyle=":", linewidth=0.8,
               label="call_timeout")
    _label_medians(ax, ours, 1e3, "ms")
    ax.legend(fontsize=7)
    ax.set_title("Failure notice, world_size 2", fontsize=9)


def startup_panel(ax: Axes, r: Results, s: Settings) -> None:
    wss = s.startup_world_sizes
    _bars(ax, [f"world_size {ws}" for ws in wss], {
        'floor: N× bare "import torch"': [r.get("start", f"ws{ws}", FLOOR) for ws in wss],
        OURS: [r.get("start", f"ws{ws}", OURS) for ws in wss],
    }, 1.0, "s to ready")
    ax.set_title("Start-up with torch + process group", fontsize=9)


def streaming_panel(ax: Axes, r: Results, s: Settings) -> None:
    pools = {f"keep_free_segments={s.stream_items}": streaming.WARM_POOL,
             "default (2)": streaming.DEFAULT_POOL}
    groups = [f"first item\n{p}" for p in pools] + [f"whole step\n{p}" for p in pools]
    metrics = [streaming.FIRST] * len(pools) + [streaming.WHOLE] * len(pools)
    keys = list(pools.values()) * 2
    _bars(ax, groups, {
        "floor: rank 0's compute": [r.get(m, "ws2", f"{k} {FLOOR}")
                                    for m, k in zip(metrics, keys, strict=True)],
        OURS: [r.get(m, "ws2", k) for m, k in zip(metrics, keys, strict=True)],
    }, 1e3, "ms")
    ax.set_title(f"stream(): {s.stream_items} items of {s.stream_item_bytes / 1e6:g} MB,"
                 " world_size 2", fontsize=9)


def aio_panel(ax: Axes, r: Results, s: Settings) -> None:
    keys = (aio_calls.GENERATE, aio_calls.AGENERATE, aio_calls.ASTREAM)
    values = [r.get(aio_calls.METRIC, "ws2", k) for k in keys]
    _bars(ax, list(keys), {OURS: values}, 1e6, "µs per call")
    _label_medians(ax, values, 1e6, "µs")
    ax.set_title("asyncio per call, echo worker, world_size 2", fontsize=9)


Panel = Callable[[Axes, Results, Settings], None]
PANELS: dict[str, Panel] = {
    "overhead": overhead_panel,
    "frames": frames_panel,
    "broadcast": broadcast_panel,
    "failure": failure_panel,
    "startup": startup_panel,
    "streaming": streaming_panel,
    "asyncio": aio_panel,
    "world-size": world_size_panel,
}


def write_all(r: Results, s: Settings, out_dir: Path, stem: str) -> list[Path]:
    """One PNG per family plus an overview of all of them; returns the paths, overview
    first."""
    paths = []
    fig = plt.figure(figsize=(13, 21))
    grid = fig.add_gridspec(5, 2)
    places = {"overhead": grid[0, 0], "frames": grid[0, 1], "broadcast": grid[1, :],
              "failure": grid[2, 0], "startup": grid[2, 1],
              "streaming": grid[3, 0], "asyncio": grid[3, 1], "world-size": grid[4, 0]}
    fig.suptitle(f"reactor_dist benchmarks, {stem}"
                 " (bars: median, whiskers: p10–p90, dots: p99)", fontsize=11)
    for name, panel in PANELS.items():
        panel(fig.add_subplot(places[name]), r, s)
    fig.tight_layout()
    path = out_dir / f"{stem}-overview.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)
    for name, panel in PANELS.items():
        fig, ax = plt.subplots(figsize=(11 if name == "broadcast" else 6.5, 4.2))
        panel(ax, r, s)
        fig.tight_layout()
        path = out_dir / f"{stem}-{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
