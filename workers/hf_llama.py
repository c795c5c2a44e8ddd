"""A real third-party tensor-parallel model in the ranks: transformers' own Llama.

A tiny ``LlamaForCausalLM`` (seeded random weights from a small config, saved to a local
directory: nothing is downloaded) is loaded on every rank with transformers' own tensor
parallelism, ``from_pretrained(dir, distributed_config=DistributedConfig(tp_size=N))``,
over the torch group the runner formed: each rank holds 1/N of every attention and MLP
projection (``q_proj`` split by output features, ``o_proj`` by input features) and
transformers all_reduces where its plan says.  ``generate(token_ids)`` returns rank 0's
logits for the whole sequence; they match world_size 1 to float32 rounding.

``rejoin()`` after a restart loads this rank's shard again: transformers' device mesh
(and the DTensors on it) belongs to the torch group the restart destroyed.

``python -m workers.hf_llama``, from the checkout (``workers/`` is not an installed
package), is the docs' recipe as a command: it saves the tiny Llama to a temporary
directory, runs it at world_size 2 and 1 on the CPU and prints the largest difference
of the logits.
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any

import numpy as np

from reactor_dist import DistributedRunner, DistributedWorker

# 6 heads of 16, an MLP of 192: every projection splits in two and in three
TINY = {"vocab_size": 256, "hidden_size": 96, "intermediate_size": 192, "num_hidden_layers": 2,
        "num_attention_heads": 6, "num_key_value_heads": 6, "max_position_embeddings": 128}
TOKENS = list(range(3, 35))  # the prompt the recipe (and its tests) run: 32 token ids
TOLERANCE = 1e-5  # world_size 2 against 1: float32 sums split over the shards round apart


def save_tiny_llama(directory: str, seed: int = 0) -> str:
    """Build the tiny Llama with seeded random weights and save it to ``directory``
    (float32, safetensors); the directory."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**TINY))
    model.save_pretrained(directory)
    return directory


def load_llama(directory: str, tp_size: int | None, device: str) -> Any:
    """The model from ``directory``; with ``tp_size``, sharded over the current torch
    group by transformers' own plan."""
    import torch
    from transformers import AutoModelForCausalLM, DistributedConfig

    options: dict[str, Any] = {"dtype": torch.float32}
    if tp_size is not None:
        options["distributed_config"] = DistributedConfig(tp_size=tp_size)
    model = AutoModelForCausalLM.from_pretrained(directory, **options)
    return model.to(device).eval()


def logits(model: Any, token_ids: Any, device: str) -> np.ndarray:
    """The model's logits for ``token_ids`` (a sequence of ints), as a float32 array."""
    import torch

    ids = torch.as_tensor(np.asarray(token_ids, dtype=np.int64)).reshape(1, -1).to(device)
    with torch.no_grad():
        out = model(input_ids=ids).logits
    full = out.full_tensor() if hasattr(out, "full_tensor") else out  # a DTensor: gathered
    return full[0].float().cpu().numpy()


class LlamaTP(DistributedWorker):
    """transformers' Llama, tensor parallel over the runner's torch group."""

    def load(self, path: str) -> None:
        self.path = path
        self.model = load_llama(path, self.world_size if self.world_size > 1 else None,
                                self.device)

    def generate(self, token_ids: Any, /) -> np.ndarray | list[tuple[int, ...]] | None:
        """Rank 0's logits for ``token_ids``; for "shards", the shape of each rank's part
        of layer 0's ``q_proj`` weight (rank 0 gathers them)."""
        if isinstance(token_ids, str) and token_ids == "shards":
            import torch.distributed as dist

            shapes: list[Any] = [self.shard_shape()]
            if self.world_size > 1:
                shapes = [None] * self.world_size
                dist.all_gather_object(shapes, self.shard_shape())
            return shapes if self.rank == 0 else None
        out = logits(self.model, token_ids, self.device)
        return out if self.rank == 0 else None

    def reset(self) -> None:
        pass  # no session state: every call is a full forward pass

    def rejoin(self) -> None:
        """The old group is gone, and with it the device mesh the shards live on: load
        this rank's shard again over the new group."""
        self.model = None
        self.load(self.path)

    def shard_shape(self) -> tuple[int, ...]:
        """The shape of this rank's part of layer 0's ``q_proj`` weight."""
        weight = self.model.model.layers[0].self_attn.q_proj.weight
        local = weight.to_local() if hasattr(weight, "to_local") else weight
        return tuple(local.shape)


def compare_world_sizes(worker: type, request: Any, **options: Any) -> int:
    """Run ``worker`` at world_size 2, then 1, on the CPU, print the largest difference of
    rank 0's answers to ``generate(request)``; 0 within TOLERANCE, else 1 (an exit code).
    Both recipes' commands (this module's and ``workers.wan_context``'s) end here."""
    answers = []
    for world_size in (2, 1):
        with DistributedRunner(worker, world_size=world_size, device="cpu",
                               start_timeout=300, **options) as runner:
            answers.append(runner.generate(request))
    difference = float(np.abs(answers[0] - answers[1]).max())
    within = difference <= TOLERANCE
    print(f"max |ws2 - ws1| = {difference:.1e} ({'within' if within else 'over'} "
          f"{TOLERANCE:.0e})")
    return 0 if within else 1


def main() -> int:
    """The recipe as one command: the tiny Llama saved to a temporary directory, which
    every rank loads from (as from a real checkpoint), at world_size 2 against 1."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # the ranks inherit it
    with tempfile.TemporaryDirectory() as directory:
        path = save_tiny_llama(directory)
        return compare_world_sizes(LlamaTP, TOKENS, load_kwargs={"path": path})


if __name__ == "__main__":
    sys.exit(main())
