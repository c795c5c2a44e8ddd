"""A Megatron-style tensor-parallel transformer block, one shard per rank.

Each rank holds a slice of every big matrix and the ranks meet twice per block:

* attention: the QKV projection is column-parallel -- rank r owns heads
  ``[r * H/N, (r+1) * H/N)`` and computes their queries, keys and values; the output
  projection is row-parallel (the input columns of those heads), so each rank's product
  is a partial sum that one ``all_reduce`` completes;
* MLP: the first linear is column-parallel (a slice of the hidden units), GELU works
  element-wise on that slice, the second linear is row-parallel, again one ``all_reduce``.

Biases of row-parallel layers are added once, after the reduction. The block keeps a
KV cache across calls, as in decoding, and ``reset()`` clears it. The full weights are
built from a seed (or read from a file) on every rank, and each rank keeps only its
shard, so any world size that divides the heads and hidden units gives the world_size 1
output up to float rounding.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from reactor_dist import DistributedWorker, share_cpu_cores

Weights = dict[str, torch.Tensor]


def make_weights(dim: int, heads: int, ffn: int, seed: int = 0) -> Weights:
    """Full (unsharded) float32 weights for one block, the same in every process."""
    if dim % heads:
        raise ValueError(f"dim={dim} is not a multiple of heads={heads}")
    g = torch.Generator().manual_seed(seed)

    def lin(out_f: int, in_f: int) -> torch.Tensor:
        return torch.randn(out_f, in_f, generator=g) / math.sqrt(in_f)

    def vec(n: int, scale: float = 0.02, base: float = 0.0) -> torch.Tensor:
        return base + scale * torch.randn(n, generator=g)

    return {
        "ln1_w": vec(dim, 0.1, 1.0), "ln1_b": vec(dim),
        "w_qkv": lin(3 * dim, dim), "b_qkv": vec(3 * dim),  # rows: all q, then all k, all v
        "w_o": lin(dim, dim), "b_o": vec(dim),
        "ln2_w": vec(dim, 0.1, 1.0), "ln2_b": vec(dim),
        "w_in": lin(ffn, dim), "b_in": vec(ffn),
        "w_out": lin(dim, ffn), "b_out": vec(dim),
    }


def save_weights(path: str | Path, weights: Weights, heads: int) -> None:
    """Write full weights (and the head count, which shapes cannot tell) for ``load()``."""
    torch.save({"heads": heads, "weights": weights}, path)


def _read_weights(path: str | Path) -> tuple[Weights, int]:
    blob = torch.load(path, map_location="cpu", weights_only=True)
    return blob["weights"], int(blob["heads"])


def shard(weights: Weights, heads: int, rank: int, world_size: int) -> Weights:
    """This rank's slice: its heads of QKV/out-proj and its hidden units of the MLP."""
    dim = weights["w_o"].shape[0]
    ffn = weights["w_in"].shape[0]
    if heads % world_size or ffn % world_size:
        raise ValueError(
            f"world_size {world_size} must divide heads={heads} and ffn={ffn}: tensor"
            " parallelism gives each rank whole heads and an equal slice of the MLP"
            f" (this block accepts world_size in {_fits(heads, ffn)})"
        )
    cols = dim // world_size  # head_dim * heads per rank
    a, b = rank * cols, (rank + 1) * cols
    f0, f1 = rank * ffn // world_size, (rank + 1) * ffn // world_size
    qkv_rows = torch.cat([torch.arange(a, b) + i * dim for i in range(3)])
    return {
        "ln1_w": weights["ln1_w"], "ln1_b": weights["ln1_b"],
        "w_qkv": weights["w_qkv"][qkv_rows], "b_qkv": weights["b_qkv"][qkv_rows],
        "w_o": weights["w_o"][:, a:b], "b_o": weights["b_o"],
        "ln2_w": weights["ln2_w"], "ln2_b": weights["ln2_b"],
        "w_in": weights["w_in"][f0:f1], "b_in": weights["b_in"][f0:f1],
        "w_out": weights["w_out"][:, f0:f1], "b_out": weights["b_out"],
    }


def _fits(heads: int, ffn: int) -> list[int]:
    return [n for n in range(1, heads + 1) if heads % n == 0 and ffn % n == 0]


class TensorParallelBlock:
    """One rank's shard of a pre-norm transformer block with causal attention."""

    def __init__(
        self, weights: Weights, heads: int, *, rank: int, world_size: int, device: str = "cpu"
    ) -> None:
        self.rank, self.world_size, self.device = rank, world_size, device
        self.w = {k: v.to(device).contiguous() for k, v in
                  shard(weights, heads, rank, world_size).items()}
        self.dim = weights["w_o"].shape[0]
        self.local_heads = heads // world_size
        self.head_dim = self.dim // heads
        self.cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def reset(self) -> None:
        """Forget the KV cache: the next call starts a new sequence."""
        self.cache = None

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(x)
        return x

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, S, dim) new tokens; they attend to the cache and causally to each other."""
        w, (bsz, seq, dim) = self.w, x.shape
        h = F.layer_norm(x, (dim,), w["ln1_w"], w["ln1_b"])
        qkv = F.linear(h, w["w_qkv"], w["b_qkv"])  # column-parallel: local heads only
        q, k, v = (t.view(bsz, seq, self.local_heads, self.head_dim).transpose(1, 2)
                   for t in qkv.chunk(3, dim=-1))
        if self.cache is not None:
            k, v = torch.cat([self.cache[0], k], 2), torch.cat([self.cache[1], v], 2)
        self.cache = (k, v)
        past = k.shape[2] - seq
        mask = torch.ones(seq, k.shape[2], dtype=torch.bool, device=x.device).tril(past)
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        att = att.transpose(1, 2).reshape(bsz, seq, -1)
        x = x + self._all_reduce(F.linear(att, w["w_o"])) + w["b_o"]  # row-parallel
        h = F.gelu(F.linear(F.layer_norm(x, (dim,), w["ln2_w"], w["ln2_b"]), w["w_in"], w["b_in"]))
        return x + self._all_reduce(F.linear(h, w["w_out"])) + w["b_out"]


class TensorParallelWorker(DistributedWorker):
    """Runs :class:`TensorParallelBlock`; input and output are float32 ``(B, S, dim)`` arrays.

    ``load(dim=64, heads=4, ffn=256, seed=0)`` builds weights from the seed, or
    ``load(weights_path=...)`` reads a file written by :func:`save_weights`.
    """

    def load(
        self, dim: int = 64, heads: int = 4, ffn: int = 256, seed: int = 0,
        weights_path: str | None = None,
    ) -> None:
        share_cpu_cores(self.world_size, self.device)
        if weights_path is not None:
            weights, heads = _read_weights(weights_path)
        else:
            weights = make_weights(dim, heads, ffn, seed)
        self.block = TensorParallelBlock(
            weights, heads, rank=self.rank, world_size=self.world_size, device=self.device
        )

    def generate(self, input: np.ndarray, /) -> np.ndarray | None:
        x = torch.tensor(np.asarray(input), dtype=torch.float32, device=self.device)
        out = self.block.forward(x)
        return out.cpu().numpy() if self.rank == 0 else None

    def reset(self) -> None:
        self.block.reset()
