"""``make demo``: the video generator through the app flow, timed, written to out/.

Runs :class:`video_app.VideoApp` (the product document's application) around the
sequence-parallel ``VideoWorker`` for several prompts; the rollout runs out part-way and
the app resets it, one step is paused. It prints each step's latency and frames/s and
writes the frames the client would have received as an animated GIF and a PNG contact
sheet under ``out/``.
"""

from __future__ import annotations

import argparse
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
    p.add_argument("--height", type=int, default=128)
    p.add_argument("--width", type=int, default=224)
    p.add_argument("--out", type=Path, default=Path("out"))
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> list[tuple[str, np.ndarray]]:
    """Drive the app; return (caption, frames) for every chunk the client received."""
    prompts = args.prompts or PROMPTS
    load_kwargs = {"frames_per_chunk": args.frames, "height": args.height, "width": args.width,
                   "chunks_per_rollout": args.chunks_per_rollout}
    app = VideoApp(world_size=args.world_size, device=args.device, load_kwargs=load_kwargs)
    t = time.perf_counter()
    app.load()
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"started {args.world_size} ranks ({device}) in {time.perf_counter() - t:.1f} s;"
          f" {args.frames} frames of {args.width}x{args.height} per step,"
          f" {args.chunks_per_rollout} chunks per rollout")
    chunks: list[tuple[str, np.ndarray]] = []
    latencies: list[float] = []
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
                t = time.perf_counter()
                out = app.step()
                dt = time.perf_counter() - t
                if out is None:
                    assert app.last_outcome and isinstance(app.last_outcome.error, RolloutExhausted)
                    print(f"  step {step:2d}  rollout exhausted -> reset() in {dt * 1e3:.1f} ms")
                else:
                    result = app.last_outcome.result
                    n = out.main_video.shape[0]
                    latencies.append(dt)
                    print(f"  step {step:2d}  chunk {result.chunk_index}  {n} frames"
                          f"  {dt * 1e3:6.1f} ms  {n / dt:6.0f} frames/s")
                    for frames in app.output.take():
                        chunks.append((f"step {step}, chunk {result.chunk_index}: {prompt}",
                                       np.array(frames)))
                step += 1
        app.on_session_ended()
    finally:
        app.close()
    warm = latencies[1:] or latencies
    med = statistics.median(warm)
    print(f"median step {med * 1e3:.1f} ms, {args.frames / med:.0f} frames/s"
          f" (world_size {args.world_size}, first step excluded)")
    return chunks


def write_gif(chunks: list[tuple[str, np.ndarray]], path: Path, fps: int = 16) -> None:
    frames = [Image.fromarray(f) for _, c in chunks for f in c]
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=1000 // fps, loop=0)


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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    chunks = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    gif, sheet = args.out / "demo.gif", args.out / "demo_sheet.png"
    write_gif(chunks, gif)
    write_sheet(chunks, sheet)
    n = sum(len(c) for _, c in chunks)
    print(f"wrote {gif} ({n} frames) and {sheet} ({len(chunks)} chunks)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
