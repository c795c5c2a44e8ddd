"""``make demo``: the video generator through the app flow, timed, written to out/.

Runs :class:`video_app.VideoApp` (the product document's application) around the
sequence-parallel ``VideoWorker`` for several prompts; the rollout runs out part-way and
the app resets it, one step is paused. Each step is streamed: the model yields its chunk
in groups of frames and each group reaches the client's track, and from there the GIF
writer, as soon as rank 0 has it. Pipelined by default (``--no-pipeline``: one step at
a time): the app sends the next chunk as soon as the current one's first group arrives,
so the ranks render it while the app hands this one over. It prints each step's time to
first frame beside its whole time and frames/s, and writes the frames the client
received as an animated GIF and a PNG contact sheet under ``out/``.

``--fault``: the same session twice, the second time with rank 1 SIGKILLed in the middle
of a step of the rollout, under ``snapshot_every=2, max_restarts=1, retry_failed=True``:
the runner restarts by itself, restores the rollout's snapshot, runs the calls since it
again and sends the failed step again; the client gets the rest of that step's frames
and never sees the fault.  It prints the restart's cost and whether every frame the
client received equals the run without the fault (SHA-256 of each chunk).
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import signal
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw

# The example models are the checkout's top-level ``workers`` package, which the
# reactor-dist wheel does not install, and ``python examples/demo.py`` puts only
# examples/ on the path: add the checkout, whatever the current directory. The ranks
# start with this process's sys.path, so they import ``workers`` from it too.
CHECKOUT = str(Path(__file__).resolve().parents[1])
if CHECKOUT not in sys.path:
    sys.path.insert(0, CHECKOUT)

from video_app import VideoApp  # noqa: E402  (imports workers: needs the checkout)

from workers.video import RolloutExhausted  # noqa: E402

PROMPTS = ["A walk through a forest.", "Neon city at night.", "Waves on a summer beach."]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Sequence-parallel video demo (see module doc).")
    p.add_argument("--world-size", type=int, default=2, help="ranks (GPUs, or CPU processes)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--prompt", action="append", dest="prompts", help="repeatable")
    p.add_argument("--steps-per-prompt", type=int, default=3)
    p.add_argument("--chunks-per-rollout", type=int, default=4)
    p.add_argument("--frames", type=int, default=16, help="frames per chunk (one step)")
    p.add_argument("--frames-per-group", type=int, default=4,
                   help="frames per streamed group (rounded up to a multiple of world size)")
    p.add_argument("--height", type=int, default=128)
    p.add_argument("--width", type=int, default=224)
    p.add_argument("--out", type=Path, default=Path("out"))
    p.add_argument("--pipeline", action=argparse.BooleanOptionalAction, default=True,
                   help="send the next chunk before handing this one over (default: on)")
    p.add_argument("--fault", action="store_true",
                   help="run it twice, SIGKILL rank 1 mid-step the second time, and compare "
                        "the frames (snapshots, retry_failed)")
    return p.parse_args(argv)


FAULT_STEP = 2  # the step in whose middle --fault kills rank 1 (chunk 2 of the first rollout)
SESSION_OPTIONS = {"snapshot_every": 2, "max_restarts": 1, "retry_failed": True}


class GifWriter:
    """Takes each group of frames as it reaches the client; encodes the GIF at ``close()``.

    ``add`` copies the frames out of the runner's shared memory (so the segment goes back
    at once) and leaves the palette encoding, tens of ms a frame, for the end: done per
    group it would compete with the ranks for the CPU and slow the steps it times.
    """

    def __init__(self, path: Path, fps: int = 16) -> None:
        self.path, self.fps = path, fps
        self.frames: list[np.ndarray] = []

    def add(self, frames: np.ndarray) -> None:
        self.frames.extend(np.array(frames))

    def close(self) -> None:
        images = [Image.fromarray(f) for f in self.frames]
        images[0].save(self.path, save_all=True, append_images=images[1:],
                       duration=1000 // self.fps, loop=0)


def run(args: argparse.Namespace, gif: GifWriter, kill_at: int | None = None,
        ) -> list[tuple[str, np.ndarray]]:
    """Drive the app, handing each group of frames to ``gif`` as it arrives; return
    (caption, frames) for every chunk the client received.  ``kill_at``: rank 1 is
    SIGKILLed once that step's first group has arrived."""
    prompts = args.prompts or PROMPTS
    load_kwargs = {"frames_per_chunk": args.frames, "frames_per_group": args.frames_per_group,
                   "height": args.height, "width": args.width,
                   "chunks_per_rollout": args.chunks_per_rollout}
    app = VideoApp(world_size=args.world_size, device=args.device, load_kwargs=load_kwargs,
                   pipeline=args.pipeline,
                   runner_options=SESSION_OPTIONS if args.fault else None)
    t = time.perf_counter()
    app.load()
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    group = math.lcm(args.frames_per_group, args.world_size)
    print(f"started {args.world_size} ranks ({device}) in {time.perf_counter() - t:.1f} s;"
          f" {args.frames} frames of {args.width}x{args.height} per step in groups of"
          f" {group}, {args.chunks_per_rollout} chunks per rollout")
    chunks: list[tuple[str, np.ndarray]] = []
    latencies: list[float] = []
    firsts: list[float] = []
    step = 0
    try:
        for i, prompt in enumerate(prompts):
            app.state.prompt = prompt
            print(f"prompt: {prompt!r}")
            if i == 1:  # the client pauses once: the step is skipped, the runner is not called
                app.state.paused = True
                t = time.perf_counter()
                app.step()
                dt = time.perf_counter() - t
                print(f"  step {step:2d}  paused, skipped in {dt * 1e3:.1f} ms")
                app.state.paused = False
                step += 1
            for _ in range(args.steps_per_prompt):
                first = None
                received: list[np.ndarray] = []
                t = time.perf_counter()
                killed = None
                for _out in app.stream_step():
                    if first is None:
                        first = time.perf_counter() - t
                        if step == kill_at:
                            victim = app.runner.ranks[1].pid
                            os.kill(victim, signal.SIGKILL)
                            killed = time.perf_counter()
                            print(f"  step {step:2d}  SIGKILLed rank 1 (pid {victim}) after "
                                  f"the step's first group")
                    for frames in app.output.take():  # what the client got: to the GIF now
                        gif.add(frames)
                        received.append(frames)
                dt = time.perf_counter() - t
                if killed is not None:
                    restart = app.runner.stats()
                    met = "the rest of the step arrived"
                    if not restart.restarts:  # the ranks had finished the step (a loaded
                        app.runner.wait_idle(timeout=60)  # machine): the step sent ahead
                        restart = app.runner.stats()      # meets the fault, if still running
                        met = "the step ended before rank 1 died; the step sent ahead recovered"
                    if restart.restarts:
                        print(f"  step {step:2d}  {met} {time.perf_counter() - killed:.2f} s "
                              f"after the kill (restarts {restart.restarts}, calls sent again "
                              f"{restart.retried}, re-run from the snapshot {restart.replayed}, "
                              f"pid of rank 1 now {app.runner.ranks[1].pid})")
                    else:  # the step sent ahead was done too
                        print(f"  step {step:2d}  the step ended before rank 1 died: the next "
                              f"call meets the fault")
                if first is None:
                    assert app.last_outcome and isinstance(app.last_outcome.error, RolloutExhausted)
                    print(f"  step {step:2d}  rollout exhausted -> reset() in {dt * 1e3:.1f} ms")
                else:
                    result = app.last_outcome.result
                    n = sum(len(f) for f in received)
                    latencies.append(dt)
                    firsts.append(first)
                    print(f"  step {step:2d}  chunk {result.chunk_index}  {n} frames"
                          f"  first frame {first * 1e3:5.1f} ms  step {dt * 1e3:6.1f} ms"
                          f"  {n / dt:5.0f} frames/s  {compute_per_rank(app.runner)}")
                    # result.prompt: pipelined, a new prompt shows one chunk later
                    chunks.append((f"step {step}, chunk {result.chunk_index}: {result.prompt}",
                                   np.concatenate(received)))
                step += 1
        app.on_session_ended()
    finally:
        app.close()
    warm = latencies[1:] or latencies
    warm_first = firsts[1:] or firsts
    med = statistics.median(warm)
    how = "pipelined" if args.pipeline else "one step at a time"
    print(f"median first frame {statistics.median(warm_first) * 1e3:.1f} ms,"
          f" median step {med * 1e3:.1f} ms, {args.frames / med:.0f} frames/s"
          f" (world_size {args.world_size}, {how}, first step excluded)")
    return chunks


def write_sheet(chunks: list[tuple[str, np.ndarray]], path: Path, per_row: int = 6) -> None:
    """One row per chunk: evenly spaced frames, captioned with step, chunk and prompt."""
    _, h, w, _ = chunks[0][1].shape
    cap, gap = 16, 2
    sheet = Image.new("RGB", (per_row * (w + gap) - gap, len(chunks) * (h + cap)), "white")
    draw = ImageDraw.Draw(sheet)
    for r, (caption, frames) in enumerate(chunks):
        y = r * (h + cap)
        draw.text((2, y + 2), caption, fill="black")
        picks = np.linspace(0, len(frames) - 1, per_row).round().astype(int)
        for c, i in enumerate(picks):
            sheet.paste(Image.fromarray(frames[i]), (c * (w + gap), y + cap))
    sheet.save(path)


def compute_per_rank(runner) -> str:
    """Each rank's seconds inside the model in the last step (runner.last_timings)."""
    timings = runner.last_timings
    if timings is None:
        return ""
    ranks = " ".join(f"{c * 1e3:.1f}" for c in timings.compute)
    return f"compute per rank {ranks} ms (slowest: rank {timings.slowest_rank})"


def checksums(chunks: list[tuple[str, np.ndarray]]) -> list[str]:
    return [hashlib.sha256(np.ascontiguousarray(frames)).hexdigest() for _, frames in chunks]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    gif, sheet = GifWriter(args.out / "demo.gif"), args.out / "demo_sheet.png"
    if args.fault:
        print("without the fault:")
        clean = checksums(run(args, GifWriter(args.out / "demo_clean.gif")))
        print(f"with rank 1 SIGKILLed in step {FAULT_STEP}:")
    chunks = run(args, gif, kill_at=FAULT_STEP if args.fault else None)
    if args.fault:
        same = checksums(chunks) == clean
        print(f"the frames the client received: {'identical to' if same else 'NOT the same as'}"
              f" the run without the fault ({len(chunks)} chunks, SHA-256 each)")
        if not same:
            return 1
    gif.close()
    write_sheet(chunks, sheet)
    n = sum(len(c) for _, c in chunks)
    print(f"wrote {gif.path} ({n} frames) and {sheet} ({len(chunks)} chunks)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
