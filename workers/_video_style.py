"""What a prompt means to the video model: wave pattern, motion and colour palette.

A prompt (and optional seed) is hashed into a :class:`Style`. Styles interpolate, so a
prompt change mid-rollout morphs the picture instead of cutting it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

WAVES = 3  # travelling waves per latent channel


def stable_seed(*parts: object) -> int:
    """A seed that is the same in every process (``hash()`` is salted per process)."""
    digest = hashlib.sha256("\0".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little")


def _rng(*parts: object) -> np.random.Generator:
    return np.random.default_rng(stable_seed(*parts))


@dataclass(frozen=True)
class Style:
    kx: np.ndarray  # (C, K) spatial frequency, cycles per latent height
    ky: np.ndarray  # (C, K)
    omega: np.ndarray  # (C, K) phase speed, radians per frame
    amp: np.ndarray  # (C, K)
    phase0: np.ndarray  # (C, K) phase at the rollout's first frame
    palette: np.ndarray  # (4, 3): colour = a + b * cos(2 pi (c * tone + d)), rows a, b, c, d

    def lerp(self, other: Style, alpha: float) -> Style:
        """Move ``alpha`` of the way toward ``other`` (the starting phase is kept)."""

        def mix(a: np.ndarray, b: np.ndarray) -> np.ndarray:
            return a + alpha * (b - a)

        return Style(
            mix(self.kx, other.kx), mix(self.ky, other.ky), mix(self.omega, other.omega),
            mix(self.amp, other.amp), self.phase0, mix(self.palette, other.palette),
        )


def style_for(prompt: str, seed: int | None, channels: int) -> Style:
    """The style a prompt asks for; the seed picks a variant of it."""
    rng = _rng("style", prompt, seed)
    shape = (channels, WAVES)
    freq = rng.uniform(0.4, 1.6, shape)
    angle = rng.uniform(0, 2 * np.pi, shape)
    speed = rng.uniform(0.05, 0.16, shape) * rng.choice([-1.0, 1.0], shape)
    palette = np.stack([
        rng.uniform(0.45, 0.55, 3),  # a: mid level
        rng.uniform(0.40, 0.50, 3),  # b: contrast
        rng.uniform(0.35, 0.75, 3),  # c: how fast each channel cycles with tone
        rng.uniform(0.0, 1.0, 3),  # d: hue offsets
    ])
    return Style(
        kx=freq * np.cos(angle), ky=freq * np.sin(angle), omega=speed,
        amp=rng.uniform(0.6, 1.0, shape) / np.sqrt(WAVES),
        phase0=rng.uniform(0, 2 * np.pi, shape), palette=palette,
    )


def noise_keyframe(seed: int, n: int, channels: int) -> np.ndarray:
    """Coarse latent noise for keyframe ``n`` of a rollout, (C, 4, 6); frames blend two."""
    return _rng("noise", seed, n).standard_normal((channels, 4, 6))
