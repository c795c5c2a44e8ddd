"""A sequence-parallel video generator: each rank renders its slice of a chunk's frames.

The model is small but it is a real sequence-parallel computation, laid out the way
autoregressive video models split work across GPUs. A step renders one chunk of frames
(16 by default) in groups (4 frames by default) and yields each group as soon as it is
done, so the first frames reach the caller long before the chunk's end. For each group:

* a latent video (travelling waves plus smooth value noise, seeded from the prompt and
  the rollout) is built frame by frame -- each rank builds only its own frames of the
  group;
* a causal sliding-window temporal attention layer mixes every frame with the frames
  just before it: each rank computes keys/values for its own frames and ``all_gather``
  hands every rank the whole group's (the cross-rank dependence); the last frames before
  the group (of earlier groups, and of the previous chunk) are kept as context, so
  groups and chunks continue each other without a seam;
* a small conv decoder upsamples the latents and maps them through a colour palette;
* the group's uint8 frames are gathered onto rank 0, straight into a shared-memory
  buffer from ``shared_empty`` so that handing them to the caller costs no copy (on a
  GPU, NCCL gathers into one device buffer and one copy moves it into that buffer).

Everything runs in float64 and every per-frame quantity depends only on the frame's
global index, never on how frames are split: the uint8 frames at world_size 2 or 4, in
groups of any size, are the same as at world_size 1 rendering the chunk in one piece.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from reactor_dist import DistributedWorker, share_cpu_cores
from workers._video_style import Style, noise_keyframe, stable_seed, style_for

Allocator = Callable[[tuple[int, ...], np.dtype], np.ndarray]


class RolloutExhausted(RuntimeError):
    """Every rank raises this once a rollout has produced its last chunk.

    It is the model's recoverable error: the application calls ``reset()`` and goes on.
    """


@dataclass(frozen=True)
class VideoInput:
    """One step's request: the prompt, and an optional seed for the rollout's noise."""

    prompt: str
    seed: int | None = None


@dataclass
class VideoResult:
    """One group of a chunk's frames; ``frames`` is a contiguous uint8 ``(G, H, W, 3)``
    array, the chunk's frames ``first_frame - chunk_index * T`` onwards."""

    frames: np.ndarray
    chunk_index: int
    first_frame: int
    prompt: str


@dataclass
class _Rollout:
    """Per-session state, replicated identically on every rank."""

    chunk: int = 0
    seed: int | None = None
    style: Style | None = None
    phase: np.ndarray | None = None  # accumulated wave phase, (C, K)
    context_kv: torch.Tensor | None = None  # last window-1 frames' keys/values (2,W-1,D,h,w)


class ParallelVideoModel:
    """The model proper; knows its rank but nothing about the runner."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        device: str = "cpu",
        alloc: Allocator = np.empty,
        frames_per_chunk: int = 16,
        frames_per_group: int = 4,
        height: int = 128,
        width: int = 224,
        chunks_per_rollout: int = 4,
        window: int = 8,
        latent_channels: int = 8,
        hidden: int = 16,
        weights_seed: int = 0,
        transition: float = 0.08,
    ) -> None:
        if frames_per_chunk % world_size:
            raise ValueError(
                f"world_size {world_size} does not divide frames_per_chunk={frames_per_chunk}:"
                " each rank renders an equal slice of the chunk's frames"
                f" (use a world_size among {_divisors(frames_per_chunk)})"
            )
        group = math.lcm(frames_per_group, world_size) if frames_per_group >= 1 else 0
        if not group or frames_per_chunk % group:
            raise ValueError(
                f"frames_per_group={frames_per_group} at world_size {world_size} gives groups"
                f" of {group or frames_per_group} frames (a multiple of world_size), which must"
                f" divide frames_per_chunk={frames_per_chunk}"
            )
        if height % 8 or width % 8:
            raise ValueError(f"height and width must be multiples of 8, got {height}x{width}")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if chunks_per_rollout < 1:
            raise ValueError(f"chunks_per_rollout must be >= 1, got {chunks_per_rollout}")
        self.rank, self.world_size, self.device, self.alloc = rank, world_size, device, alloc
        self.T, self.H, self.W = frames_per_chunk, height, width
        # Each step yields the chunk in groups of G frames (frames_per_group, rounded up to
        # a multiple of world_size); each rank renders local_G frames of every group.
        self.G = group
        self.local_G = group // world_size
        self.chunks_per_rollout = chunks_per_rollout
        self.window = window
        self.C = latent_channels
        self.transition = transition
        self.weights = self._init_weights(weights_seed, latent_channels, hidden)
        self.state = _Rollout()
        self.gathered: torch.Tensor | None = None  # rank 0's device buffer for a GPU gather

    # -- weights -------------------------------------------------------------------
    def _init_weights(self, seed: int, c: int, hidden: int) -> dict[str, torch.Tensor]:
        """Same seed, same weights on every rank: the decoder is replicated, not split."""
        rng = np.random.default_rng(seed)

        def w(*shape: int, gain: float = 1.0) -> torch.Tensor:
            fan_in = int(np.prod(shape[1:]))
            arr = rng.standard_normal(shape) * gain / np.sqrt(fan_in)
            return torch.from_numpy(arr).to(self.device)

        d = c  # attention width
        return {
            "wq": w(d, c), "wk": w(d, c), "wv": w(d, c), "wo": w(c, d, gain=0.7),
            "conv1": w(hidden, c, 3, 3, gain=1.5), "conv2": w(hidden, hidden, 3, 3, gain=1.4),
            "head": w(2, hidden, gain=1.0),
        }

    # -- the step ------------------------------------------------------------------
    def reset(self) -> None:
        """Start a new rollout; the weights stay loaded."""
        self.state = _Rollout()

    def generate(self, inp: VideoInput) -> Iterator[VideoResult | None]:
        """Render the rollout's next chunk, one group of frames at a time.

        A generator: each group of ``frames_per_group`` frames is computed and gathered
        onto rank 0, then yielded (rank 0 yields its :class:`VideoResult`, other ranks
        ``None``), so the first group reaches the caller before the chunk is done.
        """
        st = self.state
        if st.chunk >= self.chunks_per_rollout:
            # Decided from replicated state, so every rank raises, before any collective.
            raise RolloutExhausted(
                f"rollout ended after {self.chunks_per_rollout} chunks; call reset()"
            )
        if st.seed is None:
            st.seed = inp.seed if inp.seed is not None else stable_seed("rollout", inp.prompt)
        target = style_for(inp.prompt, inp.seed, self.C)
        styles, phases = self._style_trajectory(target)
        chunk, t0 = st.chunk, st.chunk * self.T
        st.style, st.phase = styles[-1], phases[-1]
        st.chunk += 1
        for g0 in range(0, self.T, self.G):
            lo = g0 + self.rank * self.local_G  # this rank's first frame of the group
            local = range(lo, lo + self.local_G)
            z = torch.stack([self._latent(t0 + i, styles[i], phases[i]) for i in local])
            z = self._temporal_attention(z)
            rgb = self._decode(z, [styles[i] for i in local])
            frames = self._gather(rgb)
            yield None if frames is None else VideoResult(
                frames, chunk_index=chunk, first_frame=t0 + g0, prompt=inp.prompt
            )

    def _style_trajectory(self, target: Style) -> tuple[list[Style], list[np.ndarray]]:
        """Every frame's style and wave phase for the whole chunk, computed on every rank.

        A new prompt does not cut: the style eases toward it frame by frame, and the phase
        integrates each frame's speed, so motion stays continuous across chunks.
        """
        st = self.state
        style = st.style if st.style is not None else target
        phase = st.phase if st.phase is not None else target.phase0.copy()
        styles, phases = [], []
        for _ in range(self.T):
            style = style.lerp(target, self.transition)
            phase = phase + style.omega
            styles.append(style)
            phases.append(phase)
        return styles, phases

    def _latent(self, t: int, style: Style, phase: np.ndarray) -> torch.Tensor:
        """Frame ``t``'s latent, (C, h, w): travelling waves plus smooth value noise."""
        h, w = self.H // 8, self.W // 8
        y = np.linspace(0.0, 1.0, h)[:, None, None, None]
        x = np.linspace(0.0, w / h, w)[None, :, None, None]
        arg = 2 * np.pi * (style.kx * x + style.ky * y) + phase  # (h, w, C, K)
        waves = (style.amp * np.sin(arg)).sum(-1).transpose(2, 0, 1)
        period = 12
        n, u = divmod(t, period)
        u = u / period
        u = u * u * (3 - 2 * u)  # smoothstep: no kinks at keyframes
        key = (1 - u) * noise_keyframe(self.state.seed, n, self.C) + u * noise_keyframe(
            self.state.seed, n + 1, self.C
        )
        noise = F.interpolate(
            torch.from_numpy(key)[None], size=(h, w), mode="bicubic", align_corners=True
        )[0].numpy()
        return torch.from_numpy(waves + 0.6 * noise).to(self.device)

    def _temporal_attention(self, z: torch.Tensor) -> torch.Tensor:
        """Sliding-window causal attention over time, per latent pixel, for one group.

        Frame t attends to frames t-window+1 .. t. Keys/values come from every rank (the
        group's frames before a rank's first one live on the ranks before it), and the
        last window-1 frames before the group are kept as context, so a group's (and a
        chunk's) first frame is computed exactly like any other: no seam. Each query
        sees its own window of keys, laid out the same way whatever the group size and
        world_size, so the frames do not depend on how they are split.
        """
        wt = self.weights
        q = torch.einsum("dc,tchw->tdhw", wt["wq"], z)
        kv_local = torch.stack(
            [torch.einsum("dc,tchw->tdhw", wt["wk"], z), torch.einsum("dc,tchw->tdhw", wt["wv"], z)]
        )
        if self.world_size > 1:
            parts = [torch.empty_like(kv_local) for _ in range(self.world_size)]
            dist.all_gather(parts, kv_local.contiguous())
            kv = torch.cat(parts, dim=1)  # (2, G, D, h, w), the group's frames in order
        else:
            kv = kv_local
        ctx = self.state.context_kv
        n_ctx = 0 if ctx is None else ctx.shape[1]
        keys = torch.cat([ctx, kv], dim=1) if ctx is not None else kv
        w = self.window
        # Left-pad to a full window before the rollout's first frame (masked out below).
        padded = torch.cat([keys.new_zeros((2, w - 1, *keys.shape[2:])), keys], dim=1)
        first = n_ctx + self.rank * self.local_G  # index in keys of this rank's first query
        starts = range(first, first + q.shape[0])  # padded index of each query's window
        windows = torch.stack([padded[:, s : s + w] for s in starts], dim=1)  # (2,q,w,D,h,w)
        scores = torch.einsum("qdhw,qkdhw->hwqk", q, windows[0]) / np.sqrt(q.shape[1])
        valid = torch.tensor([[s + j >= w - 1 for j in range(w)] for s in starts],
                             device=z.device)  # key before the rollout's first frame: none
        scores = scores.masked_fill(~valid, float("-inf"))
        out = torch.einsum("hwqk,qkdhw->qdhw", scores.softmax(-1), windows[1])
        self.state.context_kv = keys[:, max(0, keys.shape[1] - (w - 1)) :] if w > 1 else None
        return z + torch.einsum("cd,tdhw->tchw", wt["wo"], out)

    def _decode(self, z: torch.Tensor, styles: list[Style]) -> torch.Tensor:
        """Conv decoder to full size, then a per-frame colour palette: (t, H, W, 3) uint8."""
        wt = self.weights
        x = F.gelu(F.conv2d(z, wt["conv1"], padding=1))
        x = F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False)
        x = F.gelu(F.conv2d(F.pad(x, (1, 1, 1, 1), mode="replicate"), wt["conv2"]))
        x = torch.einsum("oc,tchw->tohw", wt["head"], x)
        x = F.interpolate(x, size=(self.H, self.W), mode="bicubic", align_corners=False)
        pal = torch.from_numpy(np.stack([s.palette for s in styles])).to(z.device)  # (t,4,3)
        a, b, c, d = (pal[:, i, None, None, :] for i in range(4))
        tone = x[:, 0, :, :, None]
        light = 0.8 + 0.2 * torch.tanh(x[:, 1, :, :, None])
        rgb = (a + b * torch.cos(2 * np.pi * (c * tone + d))) * light
        return (rgb.clamp(0, 1) * 255).round().to(torch.uint8)

    def _gather(self, rgb: torch.Tensor) -> np.ndarray | None:
        """Gather every rank's frames of a group onto rank 0 into one contiguous uint8
        array, a fresh ``shared_empty`` buffer per group: on the CPU (gloo) straight
        into it; on a GPU (NCCL gathers into device memory only) into one device buffer
        kept across groups, then one device-to-host copy into it (page-locked there)."""
        if self.rank == 0:
            out = self.alloc((self.G, self.H, self.W, 3), np.dtype(np.uint8))
        if self.world_size == 1:
            torch.from_numpy(out).copy_(rgb)
            return out
        if self.rank != 0:
            dist.gather(rgb.contiguous(), None, dst=0)
            return None
        host = torch.from_numpy(out)
        on_cpu = rgb.device.type == "cpu"
        if not on_cpu and (self.gathered is None or self.gathered.shape != host.shape):
            self.gathered = torch.empty(host.shape, dtype=torch.uint8, device=rgb.device)
        into = host if on_cpu else self.gathered
        views = [into[r * self.local_G : (r + 1) * self.local_G] for r in range(self.world_size)]
        dist.gather(rgb.contiguous(), views, dst=0)
        if not on_cpu:
            host.copy_(into)
        return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


class VideoWorker(DistributedWorker):
    """Adapter between the runner and :class:`ParallelVideoModel` (one per rank)."""

    def load(self, **model_kwargs: object) -> None:
        share_cpu_cores(self.world_size, self.device)
        alloc = getattr(self, "shared_empty", None) or np.empty
        self.model = ParallelVideoModel(
            rank=self.rank, world_size=self.world_size, device=self.device, alloc=alloc,
            **model_kwargs,
        )

    def generate(self, input: VideoInput, /) -> Iterator[VideoResult | None]:
        """A generator: ``runner.stream(x)`` hands over each group as rank 0 yields it,
        ``runner.generate(x)`` returns the chunk's groups as a list."""
        return self.model.generate(input)

    def reset(self) -> None:
        self.model.reset()

    def snapshot(self) -> _Rollout:
        """The session (``snapshot_every=``): the rollout's state, replicated on every
        rank (a tensor on a GPU crosses as its CPU copy); the weights are not in it."""
        return self.model.state

    def restore(self, state: _Rollout) -> None:
        """After a restart: the rollout goes on from the snapshot, on this rank's device."""
        if state.context_kv is not None:
            state.context_kv = state.context_kv.to(self.device)
        self.model.state = state

    def rejoin(self) -> None:
        """A restart kept this rank: nothing of the model depends on the old group (its
        collectives use the default group, which the runner forms anew)."""
