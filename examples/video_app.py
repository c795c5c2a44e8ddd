"""The product document's video app, with the hosting platform replaced by a small loop.

In Reactor, ``VideoApp`` is a ``ReactorApp``: the platform calls ``process_input``,
``generate`` and ``process_output`` once per step, runs commands (``reset``) and hooks
(session end) between steps, and streams ``VideoOutput`` to the client. Here
:meth:`VideoApp.stream_step` plays the platform's part for one step and a :class:`Track`
stands in for the client's video track, so the same flow runs from a terminal or a test.

The step is streamed: ``generate`` returns ``runner.stream(input)``, the model yields
its chunk in groups of frames, and each group goes through ``process_output`` onto the
track as soon as rank 0 has it, so the client's first frames do not wait for the
chunk's end.
With ``pipeline=True`` (``--pipeline``) the app sends the next chunk as soon as the
current one's first group arrives, before handing that group to ``process_output``: the
ranks render chunk n+1 while the app is still busy with chunk n (two calls in flight,
the runner's default ``max_in_flight=2``). The input of chunk n+1 is read then, so a
change of prompt shows one chunk later; a pause skips steps and keeps the chunk already
sent for the step after it; ``reset()`` drops it (the ranks finish it, its frames unread).
Everything else -- what goes to the runner, the ``RolloutExhausted`` -> ``reset()``
recovery, pausing, "any other error: shut down and re-raise", and the session-end
choice between reset and shutdown -- is the document's code.

Run it: ``python examples/video_app.py --world-size 2 --steps 6 [--pipeline]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from reactor_dist import DistributedRunner, Stream

# The example models are the checkout's top-level ``workers`` package, which the
# reactor-dist wheel does not install, and ``python examples/video_app.py`` puts only
# examples/ on the path: add the checkout, whatever the current directory. The ranks
# start with this process's sys.path, so they import ``workers`` from it too.
CHECKOUT = str(Path(__file__).resolve().parents[1])
if CHECKOUT not in sys.path:
    sys.path.insert(0, CHECKOUT)

from workers.video import RolloutExhausted, VideoInput, VideoResult, VideoWorker  # noqa: E402


class ApplicationError(Exception):
    """Raised by ``process_input`` to skip a step without an error (here: paused)."""


@dataclass
class VideoState:
    """What the client controls between steps."""

    prompt: str = "A walk through a forest."
    paused: bool = False


@dataclass
class StepOutcome:
    """One item of a step's stream (a group of frames), or the exception the step raised."""

    result: VideoResult | None = None
    error: BaseException | None = None


@dataclass
class VideoOutput:
    main_video: np.ndarray  # (G, H, W, 3) uint8: one group of the chunk's frames


@dataclass
class Track:
    """Stand-in for the client's video track: frames pushed, not yet sent, can be dropped."""

    pending: list[np.ndarray] = field(default_factory=list)

    def push(self, frames: np.ndarray) -> None:
        self.pending.append(frames)

    def take(self) -> list[np.ndarray]:
        """What the client receives: everything pushed since the last take."""
        out, self.pending = self.pending, []
        return out

    def flush(self) -> None:
        """Drop frames of the old rollout that the client has not received yet."""
        self.pending.clear()


class VideoApp:
    """The document's ``VideoApp``; only ``step()`` is ours (the platform's role)."""

    def __init__(
        self, *, world_size: int = 2, device: str = "auto",
        load_kwargs: dict[str, Any] | None = None, call_timeout: float = 30.0,
        pipeline: bool = False, runner_options: dict[str, Any] | None = None,
    ) -> None:
        self.world_size, self.device = world_size, device
        self.load_kwargs = load_kwargs or {}
        self.runner_options = runner_options or {}  # more DistributedRunner options
        self.call_timeout = call_timeout
        self.state = VideoState()
        self.output = Track()
        self.last_outcome: StepOutcome | None = None
        self.pipeline = pipeline
        self.ahead: Stream | Generator[VideoResult, None, None] | None = None  # next step, sent

    def load(self, config_path: str | None = None) -> None:
        """The one change from an in-process model: start a runner instead of a model."""
        self.runner = DistributedRunner(
            VideoWorker, world_size=self.world_size, load_kwargs=self.load_kwargs,
            call_timeout=self.call_timeout, device=self.device, **self.runner_options,
        )
        self.runner.start()

    def process_input(self) -> VideoInput:
        if self.state.paused:
            raise ApplicationError("paused")
        return VideoInput(prompt=self.state.prompt)

    def generate(self, input: VideoInput) -> Stream:
        """Streamed: the chunk's groups of frames, each as soon as rank 0 yields it."""
        return self.runner.stream(input)

    def process_output(self, outcome: StepOutcome) -> VideoOutput | None:
        if isinstance(outcome.error, RolloutExhausted):
            self.reset()  # the model's recoverable error: new rollout, weights kept
            return None
        if outcome.error is not None:
            self.drop_ahead()
            self.runner.shutdown()  # crash, timeout, desync or a model bug: end the session
            raise outcome.error
        assert outcome.result is not None
        self.output.push(outcome.result.frames)
        return VideoOutput(main_video=outcome.result.frames)

    def reset(self) -> None:
        """The "reset" command: start a new rollout."""
        self.drop_ahead()  # rendered in the old rollout
        self.runner.reset()
        self.output.flush()

    def on_session_ended(self) -> None:
        """Keep a healthy runner (weights loaded) for the next session; else release it."""
        if self.runner.healthy:
            self.reset()
        else:
            self.runner.shutdown()

    def drop_ahead(self) -> None:
        """Leave the chunk sent ahead: the ranks finish it, its frames are dropped unread."""
        ahead, self.ahead = self.ahead, None
        if ahead is not None:
            ahead.close()

    def send_ahead(self) -> None:
        """Pipelined: send the next step now, so the ranks render it during this one's
        ``process_output``. Its errors come out of that next step, as they would have."""
        try:
            inp = self.process_input()
        except ApplicationError:
            return  # paused: the next step sends its own, if any
        try:
            self.ahead = self.generate(inp)
        except Exception as exc:  # refused at once: handed over by the next step
            self.ahead = _raising(exc)

    # -- the platform's part ---------------------------------------------------------
    def stream_step(self) -> Iterator[VideoOutput]:
        """One platform step: input, generate, then ``process_output`` for each item as it
        arrives, yielding its output. Yields nothing when skipped or recovered.

        Pipelined, the step's call may already be in flight (sent ahead by the step
        before); the next one is sent once this one's first item is here."""
        try:
            inp = self.process_input()
        except ApplicationError:
            self.last_outcome = None
            return  # a chunk sent ahead stays ahead
        items, self.ahead = self.ahead, None
        sent_ahead = False
        try:
            while True:
                try:
                    if items is None:  # refused at once: input does not pickle, unusable
                        items = self.generate(inp)
                    outcome = StepOutcome(result=next(items))
                except StopIteration:
                    return
                except Exception as exc:  # the platform hands every step error over
                    outcome = StepOutcome(error=exc)
                if self.pipeline and not sent_ahead and outcome.error is None:
                    sent_ahead = True
                    self.send_ahead()  # before this chunk goes to process_output
                self.last_outcome = outcome
                output = self.process_output(outcome)
                if output is None:
                    return  # recovered (process_output raises what it cannot recover)
                yield output
        finally:
            if items is not None:  # left early: the step ends on every rank, rest unread
                items.close()

    def step(self) -> list[VideoOutput] | None:
        """One whole step (:meth:`stream_step` to its end): the outputs of its groups in
        order, or None when skipped or recovered."""
        return list(self.stream_step()) or None

    def close(self) -> None:
        """Process exit: stop the workers (the runner also does this at interpreter exit)."""
        self.drop_ahead()
        self.runner.shutdown()


def _raising(exc: BaseException) -> Generator[VideoResult, None, None]:
    """An iterator that raises ``exc`` at its first item."""
    raise exc
    yield  # a generator: the raise waits for next()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--pipeline", action=argparse.BooleanOptionalAction, default=False,
                        help="send the next chunk before handing this one to process_output")
    args = parser.parse_args()
    app = VideoApp(world_size=args.world_size, device=args.device,
                   load_kwargs={"chunks_per_rollout": 3}, pipeline=args.pipeline)
    app.load()
    shown, busy = 0, 0.0  # frames and seconds of the steps after the first
    try:
        for i in range(args.steps):
            t = time.perf_counter()
            first, frames, groups = None, 0, 0
            for out in app.stream_step():
                if first is None:
                    first = time.perf_counter() - t
                frames += out.main_video.shape[0]
                groups += 1
            dt = time.perf_counter() - t
            if i:
                shown, busy = shown + frames, busy + dt
            print(f"step {i}: {frames} frames in {groups} groups, first after"
                  f" {first * 1e3:.0f} ms, all in {dt * 1e3:.0f} ms,"
                  f" {frames / dt:.0f} frames/s" if first is not None
                  else f"step {i}: rollout exhausted -> reset in {dt * 1e3:.0f} ms")
        app.on_session_ended()
    finally:
        app.close()
    how = "pipelined (the next chunk sent ahead)" if args.pipeline else "one step at a time"
    if busy:
        print(f"{shown / busy:.0f} frames/s over steps 1-{args.steps - 1}, {how}")


if __name__ == "__main__":
    main()
