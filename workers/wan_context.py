"""A real third-party context-parallel model in the ranks: diffusers' own Wan transformer.

A tiny ``WanTransformer3DModel`` (the video diffusion transformer of Wan 2.1/2.2; seeded
random weights from a small config, built in ``load()``: nothing is downloaded) runs with
diffusers' own context parallelism, ``enable_parallelism(config=ContextParallelConfig(
ulysses_degree=N))``, over the torch group the runner formed: each rank embeds and
transforms 1/N of the video's tokens, and diffusers' hooks exchange heads and tokens with
``all_to_all_single`` around each attention (Ulysses) and gather the output.
``generate(step)`` is one denoising forward pass: rank 0 returns the predicted noise for
the whole latent video; it matches world_size 1.

Workarounds, on a CPU build of torch only: ``torch.accelerator.device_count()`` is 0
there and diffusers takes the rank modulo it, so it is given 1; diffusers' hook logs
with ``Logger.warning_once``, which only transformers' import adds, so it is imported.
``rejoin()`` after a restart makes the model parallel again over the new group (its
device mesh belonged to the group the restart destroyed): diffusers enables parallelism
once per model, so the weights, kept in memory, go into a model built anew.

``python -m workers.wan_context``, from the checkout (``workers/`` is not an
installed package), is the docs' recipe as a command: it runs the tiny Wan at
world_size 2 and 1 on the CPU and prints the largest difference of the predicted noise.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from reactor_dist import DistributedWorker
from workers.hf_llama import compare_world_sizes

# 6 heads and 192 tokens: Ulysses splits both in two and in three
TINY = {"patch_size": (1, 2, 2), "num_attention_heads": 6, "attention_head_dim": 16,
        "in_channels": 4, "out_channels": 4, "text_dim": 32, "freq_dim": 32, "ffn_dim": 64,
        "num_layers": 2, "rope_max_seq_len": 64}
LATENT = (1, 4, 3, 16, 16)  # batch, channels, frames, height, width: 3 x 8 x 8 = 192 tokens
TEXT_TOKENS = 8
STEP = 3  # the seed of the step the recipe (and its tests) run

def inputs(seed: int) -> dict[str, Any]:
    """One step's inputs, seeded: the noisy latent video, the timestep, the text."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return {"hidden_states": torch.randn(LATENT, generator=g),
            "timestep": torch.tensor([500]),
            "encoder_hidden_states": torch.randn(1, TEXT_TOKENS, TINY["text_dim"], generator=g)}

def build_wan(seed: int = 0) -> Any:
    """The tiny Wan transformer with seeded random weights, float32, eval."""
    import torch
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(**TINY).eval()

def predict(model: Any, seed: int, device: str) -> np.ndarray:
    import torch

    with torch.no_grad():
        args = {k: v.to(device) for k, v in inputs(seed).items()}
        out = model(**args, return_dict=False)[0]
    return out.float().cpu().numpy()

def cpu_workarounds() -> None:
    """What diffusers' context parallelism needs on a CPU build of torch (a no-op where
    torch sees an accelerator)."""
    import torch

    if torch.accelerator.device_count() == 0:
        torch.accelerator.device_count = lambda: 1  # diffusers takes rank % device_count()
        import transformers  # noqa: F401  (adds Logger.warning_once, which diffusers calls)

class WanContextParallel(DistributedWorker):
    """diffusers' Wan transformer, context parallel (Ulysses) over the runner's group."""

    def load(self, seed: int = 0) -> None:
        self.model = build_wan(seed).to(self.device)
        self.parallel()

    def parallel(self) -> None:
        # The tokens the first block's feed-forward sees in a forward pass: this rank's
        # share (diffusers splits the sequence in its own hook around the block).
        self.tokens_seen = 0
        self.model.blocks[0].ffn.register_forward_pre_hook(self.count_tokens)
        if self.world_size > 1:
            from diffusers import ContextParallelConfig

            cpu_workarounds()
            self.model.enable_parallelism(
                config=ContextParallelConfig(ulysses_degree=self.world_size))

    def count_tokens(self, module: Any, args: tuple) -> None:
        self.tokens_seen = int(args[0].shape[1])  # (batch, tokens, dim)

    def generate(self, seed: int, /) -> np.ndarray | list[int] | None:
        """One forward pass of the step ``seed``: rank 0's predicted noise; with a
        negative seed, the tokens each rank's blocks saw in it (rank 0 gathers them)."""
        out = predict(self.model, abs(seed), self.device)
        if seed < 0:
            import torch.distributed as dist

            seen = [self.tokens_seen]
            if self.world_size > 1:
                every: list[Any] = [None] * self.world_size
                dist.all_gather_object(every, self.tokens_seen)
                seen = every
            return seen if self.rank == 0 else None
        return out if self.rank == 0 else None

    def reset(self) -> None:
        pass  # no session state: every call is one forward pass

    def rejoin(self) -> None:
        """The old group is gone, and with it the mesh the parallel hooks use (diffusers
        enables parallelism once per model): the same weights, kept in memory, into a
        model built anew, parallel over the new group."""
        from diffusers import WanTransformer3DModel

        weights = self.model.state_dict()
        model = WanTransformer3DModel(**TINY).to(self.device)
        model.load_state_dict(weights)
        self.model = model.eval()
        self.parallel()


if __name__ == "__main__":
    # Every rank builds the same seeded weights in load(): nothing to save first.
    sys.exit(compare_world_sizes(WanContextParallel, STEP))
