"""The product document's application flow (examples/video_app.py) and the demo, for real."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from workers.video import RolloutExhausted, VideoInput

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

import demo  # noqa: E402
from video_app import VideoApp  # noqa: E402

SMALL = {"frames_per_chunk": 8, "frames_per_group": 4, "height": 32, "width": 56,
         "chunks_per_rollout": 2}
GROUP = (4, 32, 56, 3)


def chunk(outputs) -> np.ndarray:
    return np.concatenate([o.main_video for o in outputs])


def test_app_loop_recovers_pauses_and_ends_the_session():
    app = VideoApp(world_size=2, device="cpu", load_kwargs=SMALL)
    app.load()
    try:
        shown = [app.step(), app.step()]
        # Each step's chunk of 8 frames comes as two groups of 4.
        assert [[o.main_video.shape for o in s] for s in shown] == [[GROUP] * 2] * 2
        assert len(app.output.take()) == 4  # what the client received: one push per group
        # The rollout runs out: the app resets it and skips that step's output.
        assert app.step() is None
        assert isinstance(app.last_outcome.error, RolloutExhausted)
        assert app.runner.healthy
        again = app.step()
        assert app.last_outcome.result.chunk_index == 0
        assert np.array_equal(chunk(again), chunk(shown[0]))
        # Paused: the step is skipped before the runner is called.
        app.state.paused = True
        assert app.step() is None and app.last_outcome is None
        app.state.paused = False
        app.state.prompt = "Neon city at night."
        assert not np.array_equal(chunk(app.step()), chunk(again))
        # Session end with a healthy runner: reset, keep the workers for the next session.
        app.on_session_ended()
        assert app.runner.healthy
        app.step()
        assert app.last_outcome.result.chunk_index == 0
    finally:
        app.close()
    assert not app.runner.healthy


def test_app_streams_each_group_to_the_track_as_it_arrives():
    app = VideoApp(world_size=2, device="cpu", load_kwargs=SMALL)
    app.load()
    try:
        steps = app.stream_step()
        first = next(steps)  # the chunk's first group, handed over on its own
        assert first.main_video.shape == GROUP
        assert app.last_outcome.result.first_frame == 0
        [pushed] = app.output.take()  # already on the client's track
        assert pushed is first.main_video
        second = next(steps)
        assert app.last_outcome.result.first_frame == 4
        assert [p is second.main_video for p in app.output.take()] == [True]
        assert next(steps, None) is None
        # Leaving a step early: the rest is dropped, the next step is the next chunk.
        early = app.stream_step()
        next(early)
        early.close()
        app.output.take()
        assert app.runner.healthy
        assert app.step() is None  # 2 chunks per rollout: exhausted -> reset
        assert isinstance(app.last_outcome.error, RolloutExhausted)
        assert chunk(app.step())[:4].tobytes() == first.main_video.tobytes()
    finally:
        app.close()


class BrokenInputApp(VideoApp):
    """A model-side bug: every rank fails on the input in a way the app cannot recover."""

    def process_input(self) -> VideoInput:
        return "not a VideoInput"  # type: ignore[return-value]


def test_app_shuts_down_and_reraises_any_other_error():
    app = BrokenInputApp(world_size=2, device="cpu", load_kwargs=SMALL)
    app.load()
    try:
        with pytest.raises(AttributeError, match="seed"):
            app.step()
        assert not app.runner.healthy  # the app shut it down
        app.on_session_ended()  # unhealthy: shutdown again, which is harmless
        with pytest.raises(RuntimeError, match="unusable"):
            app.runner.generate(VideoInput("x"))
    finally:
        app.close()


def test_demo_runs_end_to_end_and_writes_gif_and_sheet(tmp_path, capsys):
    argv = ["--world-size", "2", "--device", "cpu", "--out", str(tmp_path),
            "--frames", "8", "--frames-per-group", "4", "--height", "32", "--width", "56",
            "--steps-per-prompt", "2", "--chunks-per-rollout", "2",
            "--prompt", "one", "--prompt", "two"]
    assert demo.main(argv) == 0
    printed = capsys.readouterr().out
    assert "paused, skipped" in printed
    assert "rollout exhausted -> reset()" in printed
    assert "frames/s" in printed and "median step" in printed
    assert "first frame" in printed and "median first frame" in printed
    gif = Image.open(tmp_path / "demo.gif")
    assert gif.n_frames == 3 * 8  # 4 steps, one exhausted (recovered), 3 chunks shown
    sheet = Image.open(tmp_path / "demo_sheet.png")
    assert sheet.size == (6 * 56 + 5 * 2, 3 * (32 + 16))
