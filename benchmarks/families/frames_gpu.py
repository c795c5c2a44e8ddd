"""Frames between a GPU and the application (issue 43): every row of
:data:`benchmarks.gpu_frames.ROWS`, each next to its floor (a copy between the GPU and
pinned memory) measured in the same run, a row with a goal judged against it (≤ 1.2×).

The measurement is ``python -m benchmarks.gpu_check --frames`` in a process of its own
(the one ``make gpu-check`` runs): the first call of a 97 MB CUDA tensor (its segment's
registration) apart from the steady state, the results of each kind returned and
streamed, ``.cpu().numpy()`` and ``shared_empty`` for comparison, an input to the GPU
with ``to_device``.  On a machine without CUDA it says so and has no rows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from benchmarks.config import Settings
from benchmarks.report.results import Results, Row
from benchmarks.report.stats import summarize

METRIC = "gpu frames"
TIMEOUT_S = 300
NO_GPU = ("gpu frames: no CUDA GPU here; the rows of frames between a GPU and the "
          "application run where one is (make bench, make gpu-check)")


def cuda_here() -> bool:
    """Whether torch sees a GPU, asked in a process of its own (this one never
    initialises CUDA)."""
    probe = [sys.executable, "-c", "import torch, sys; sys.exit(not torch.cuda.is_available())"]
    try:
        return subprocess.run(probe, capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def measure(settings: Settings, results: Results) -> None:
    if not cuda_here():  # not a problem of the run: the section is left out
        print(NO_GPU, flush=True)
        return
    with tempfile.TemporaryDirectory() as work:
        path = os.path.join(work, "frames.json")
        run = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--frames", path],
                             capture_output=True, text=True, timeout=TIMEOUT_S)
        if run.returncode != 0 or not os.path.exists(path):
            results.notes.append(f"gpu frames: the measurement failed ({run.returncode}): "
                                 f"{run.stderr[-400:]}")
            return
        with open(path) as f:
            timings = json.load(f)
    for key, timing in timings.items():
        if "median" in timing:
            results.put(METRIC, key, "seconds", summarize([timing["median"]]))
        else:
            results.notes.append(f"gpu frames: {key}: {timing.get('error', '?')}")


def rows(results: Results, settings: Settings) -> list[Row]:
    from benchmarks.gpu_frames import ROWS

    section = ("Frames between the GPU and the application (world_size 1; floor: a copy "
               "between the GPU and pinned memory, same run)")
    out = []
    for frame_row in ROWS:
        ours = results.get(METRIC, frame_row.key, "seconds")
        if ours is None:
            continue
        floor = results.get(METRIC, frame_row.floor, "seconds") if frame_row.floor else None
        row = Row(section=section, case=frame_row.label,
                  unit="s" if frame_row.key == "start" else "ms", ours=ours, floor=floor,
                  floor_label="a copy between the GPU and pinned memory")
        if frame_row.goal is not None:
            ratio = row.over_floor
            row.target = f"≤ {frame_row.goal:g}× floor"
            row.met = ratio is not None and ratio <= frame_row.goal
        out.append(row)
    return out
