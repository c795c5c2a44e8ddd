"""The ready workers, run by real runners: parallel results equal the single-rank ones.

The world_size 1 references are computed in this process with the same model classes
(rank 0 of 1, no process group), which saves a runner start per test.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from reactor_dist import DistributedRunner
from workers.tensor_parallel import (
    TensorParallelBlock,
    TensorParallelWorker,
    make_weights,
    save_weights,
)
from workers.video import ParallelVideoModel, RolloutExhausted, VideoInput, VideoWorker

TP = {"dim": 32, "heads": 4, "ffn": 64, "seed": 0}
VIDEO = {"frames_per_chunk": 8, "height": 64, "width": 112, "chunks_per_rollout": 3}
VIDEO_STEPS = [VideoInput("A walk through a forest.", seed=7)] * 2 + [VideoInput("Neon city.")]


def tp_calls(call, reset) -> list[np.ndarray]:
    """Two calls that share the KV cache, a reset, then the second input again, fresh."""
    rng = np.random.default_rng(1)
    x0, x1 = (rng.standard_normal((2, n, TP["dim"])).astype(np.float32) for n in (5, 3))
    out = [call(x0), call(x1)]
    reset()
    return [*out, call(x1)]


def tp_reference() -> list[np.ndarray]:
    weights = make_weights(TP["dim"], TP["heads"], TP["ffn"], TP["seed"])
    block = TensorParallelBlock(weights, TP["heads"], rank=0, world_size=1)
    return tp_calls(lambda x: block.forward(torch.from_numpy(x)).numpy(), block.reset)


@pytest.mark.parametrize("world_size, from_file", [(2, True), (4, False)])
def test_tensor_parallel_block_matches_world_size_1(world_size, from_file, tmp_path):
    load_kwargs = dict(TP)
    if from_file:  # the same weights, read from a file instead of built from the seed
        path = tmp_path / "block.pt"
        save_weights(path, make_weights(TP["dim"], TP["heads"], TP["ffn"], TP["seed"]),
                     TP["heads"])
        load_kwargs = {"weights_path": str(path)}
    with DistributedRunner(TensorParallelWorker, world_size=world_size,
                           load_kwargs=load_kwargs, device="cpu") as runner:
        got = tp_calls(runner.generate, runner.reset)
        assert runner.healthy
    want = tp_reference()
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == np.float32
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    # The KV cache matters, and reset() clears it: the same tokens with and without history.
    assert np.abs(want[1] - want[2]).max() > 0.1


def test_tensor_parallel_refuses_a_world_size_that_does_not_divide():
    runner = DistributedRunner(TensorParallelWorker, world_size=3, load_kwargs=TP,
                               device="cpu")
    with pytest.raises(ValueError, match=r"world_size 3 must divide heads=4 and ffn=64.*"
                                         r"accepts world_size in \[1, 2, 4\]"):
        runner.start()
    assert not runner.healthy
    runner.shutdown()


def test_video_refuses_a_world_size_that_does_not_divide():
    with pytest.raises(ValueError, match="world_size 3 does not divide frames_per_chunk=8"):
        ParallelVideoModel(rank=0, world_size=3, **VIDEO)


def test_video_refuses_groups_that_do_not_divide_the_chunk():
    with pytest.raises(ValueError, match=r"frames_per_group=3 at world_size 1 gives groups of 3"
                                         r" frames .* must divide frames_per_chunk=8"):
        ParallelVideoModel(rank=0, world_size=1, frames_per_group=3, **VIDEO)
    # Groups are rounded up to a multiple of world_size: 4 frames at world_size 8 -> 8.
    assert ParallelVideoModel(rank=0, world_size=8, **VIDEO).G == 8


@functools.lru_cache(maxsize=1)
def video_reference() -> tuple[np.ndarray, ...]:
    """Each step's chunk at world_size 1, rendered in one piece (one group of 8 frames)."""
    model = ParallelVideoModel(rank=0, world_size=1, frames_per_group=8, **VIDEO)
    chunks = []
    for step in VIDEO_STEPS:
        [whole] = model.generate(step)
        chunks.append(whole.frames)
    return tuple(chunks)


def assert_equal_to_world_size_1(steps: list, group: int = 4) -> None:
    """Each step's groups, in order, are the step's chunk at world_size 1, byte for byte."""
    for i, (items, want) in enumerate(zip(steps, video_reference(), strict=True)):
        assert len(items) == 8 // group
        for g, item in enumerate(items):
            assert item.chunk_index == i and item.first_frame == i * 8 + g * group
            assert item.frames.shape == (group, 64, 112, 3) and item.frames.dtype == np.uint8
            assert item.frames.flags.c_contiguous
        frames = np.concatenate([item.frames for item in items])
        assert np.array_equal(frames, want), f"chunk {i}: {np.sum(frames != want)} values differ"


@pytest.mark.parametrize("group", [1, 2, 4])
def test_video_groups_at_world_size_1_equal_the_whole_chunk(group):
    model = ParallelVideoModel(rank=0, world_size=1, frames_per_group=group, **VIDEO)
    assert_equal_to_world_size_1([list(model.generate(step)) for step in VIDEO_STEPS], group)


def test_video_rollout_at_world_size_2_equals_world_size_1_then_exhausts_and_resets():
    with DistributedRunner(VideoWorker, world_size=2, load_kwargs=VIDEO, device="cpu") as runner:
        # Streamed: each group of 4 frames arrives on its own.
        assert_equal_to_world_size_1([list(runner.stream(step)) for step in VIDEO_STEPS])
        for _ in range(2):  # exhausted, and stays so until reset()
            with pytest.raises(RolloutExhausted, match="after 3 chunks"):
                list(runner.stream(VIDEO_STEPS[0]))
            assert runner.healthy  # every rank raised the same type: recoverable
        with pytest.raises(RolloutExhausted, match="after 3 chunks"):
            runner.generate(VIDEO_STEPS[0])
        runner.reset()
        # A new rollout with the same weights: the same frames again, chunk by chunk; not
        # streamed, generate() returns the chunk's groups as a list.
        assert_equal_to_world_size_1([runner.generate(step) for step in VIDEO_STEPS])
        assert runner.healthy


def test_video_frames_at_world_size_4_equal_world_size_1():
    load_kwargs = {**VIDEO, "frames_per_group": 2}  # rounded up to 4: one frame per rank
    with DistributedRunner(VideoWorker, world_size=4, load_kwargs=load_kwargs,
                           device="cpu") as runner:
        assert_equal_to_world_size_1([list(runner.stream(step)) for step in VIDEO_STEPS])


def test_video_frames_are_coherent_and_follow_the_prompt():
    """Smooth in space and time (noise would differ by ~85 per step), chunks continue."""
    video = np.concatenate(video_reference()[:2]).astype(np.int16)
    assert video.std() > 30  # colourful, not flat
    step = np.abs(np.diff(video, axis=0)).mean(axis=(1, 2, 3))
    assert step.max() < 35, step
    seam = step[7]  # last frame of chunk 0 -> first frame of chunk 1
    assert seam < 2 * np.median(step), step
    assert np.abs(np.diff(video, axis=2)).mean() < 20  # neighbouring pixels agree (noise: ~85)
    other = ParallelVideoModel(rank=0, world_size=1, frames_per_group=8, **VIDEO)
    [chunk] = other.generate(VideoInput("Neon city.", seed=7))
    assert np.abs(chunk.frames
                  - video_reference()[0].astype(np.int16)).mean() > 30
