"""How much of each benchmark to run: the full suite must fit in 5 minutes on 2 cores,
``--quick`` in 1 minute, so every loop length lives here and nowhere else."""

from __future__ import annotations

from dataclasses import dataclass

FRAME_SHAPE = (81, 480, 832, 3)  # 81 frames of 480x832 RGB: one video step, 97 MB


@dataclass(frozen=True)
class Payload:
    """A result or input size: flat uint8 except the real video step."""

    label: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


PAYLOADS = (
    Payload("1 MB", (1_000_000,)),
    Payload("16 MB", (16_000_000,)),
    Payload("97 MB", FRAME_SHAPE),
)


@dataclass(frozen=True)
class Settings:
    quick: bool
    world_sizes: tuple[int, ...] = (1, 2, 4)
    table_world_sizes: tuple[int, ...] = (1, 2, 4, 8)  # the world-size table (world_size.py)
    call_iters: int = 2000  # timed generate(1) calls per trial and configuration
    call_warmup: int = 200
    call_rounds: int = 10  # implementations alternate in this many blocks (see interleave)
    call_trials: int = 3  # fresh runner and floor peers each: the spread between trials shows
    baseline_call_iters: int = 500  # the baselines are slower; fewer calls give the same spread
    transfer_iters: tuple[int, ...] = (60, 30, 15)  # per payload, same order as PAYLOADS
    transfer_warmup: int = 3
    transfer_rounds: int = 5
    # after the checked first call (a 97 MB mp-queue echo takes a second)
    baseline_transfer_warmup: int = 1
    baseline_transfer_iters: tuple[int, ...] = (30, 12, 7)
    crash_trials: int = 8
    recovery_trials: int = 2  # each recovery case per trial, in alternating order
    joined_trials: int = 5  # each joined-rank fault (families/joined.py), alternating
    timeout_trials: int = 3
    call_timeout_s: float = 0.5
    sink_world_sizes: tuple[int, ...] = (2, 4)  # input broadcast
    startup_world_sizes: tuple[int, ...] = (1, 2, 4)
    startup_trials: int = 3
    payloads: tuple[Payload, ...] = PAYLOADS
    # streaming: a step of stream_items items of stream_item_bytes, compute between them
    stream_items: int = 8
    stream_item_bytes: int = 12_000_000
    stream_reps: int = 6  # np.sin passes per item: about 10 ms of compute on this machine
    stream_steps: int = 30  # timed steps (and as many timed computes alone)
    stream_warmup: int = 3
    stream_rounds: int = 5
    # asyncio: agenerate(1) and astream(1) against generate(1), alternating blocks
    aio_calls: int = 2000
    aio_warmup: int = 200
    aio_rounds: int = 10
    # pipelined steps: (C, W) in ms, a rank's compute and the app's own work per step
    pipeline_steps_ms: tuple[tuple[int, int], ...] = ((40, 10), (20, 20))
    pipeline_steps: int = 120  # timed steps per loop and (C, W)
    pipeline_warmup: int = 5
    pipeline_rounds: int = 4
    # a fresh 97 MB CPU buffer per call under each allocator setting (cpu_copy_settings)
    cpu_copy_calls: int = 120  # per setting; half as many in the rank comparison
    cpu_copy_rounds: int = 6


FULL = Settings(quick=False)

QUICK = Settings(
    quick=True,
    joined_trials=1,
    call_iters=300,
    call_warmup=50,
    call_rounds=4,
    call_trials=1,
    baseline_call_iters=100,
    payloads=(PAYLOADS[0], PAYLOADS[2]),  # 1 MB and the video step
    transfer_iters=(15, 5),
    transfer_warmup=2,
    transfer_rounds=3,
    baseline_transfer_warmup=0,
    baseline_transfer_iters=(3, 3),
    crash_trials=3,
    recovery_trials=1,
    timeout_trials=1,
    sink_world_sizes=(2,),
    table_world_sizes=(1, 2),
    startup_world_sizes=(2,),
    startup_trials=1,
    stream_steps=8,
    stream_warmup=1,
    stream_rounds=2,
    aio_calls=300,
    aio_warmup=50,
    aio_rounds=4,
    pipeline_steps=30,
    pipeline_warmup=2,
    pipeline_rounds=2,
    cpu_copy_calls=24,
    cpu_copy_rounds=2,
)
