"""The worker of the joined-rank tests (test_join.py, test_join_torchrun.py): ranks that
another launcher starts import it by name (``join_workers:Frames``)."""

from __future__ import annotations

import socket

import numpy as np
from restart_workers import ReducesAndRejoins


class Frames(ReducesAndRejoins):
    """A frame in, the frame mirrored and doubled out (rank 0's), with the sum every rank
    saw (an all_reduce) and the host; anything else as ReducesAndRejoins does."""

    def generate(self, x, /):
        if isinstance(x, np.ndarray):
            import torch
            import torch.distributed as dist

            seen = torch.tensor([float(x.sum(dtype=np.float64))], dtype=torch.float64)
            dist.all_reduce(seen)
            return {"frame": x[::-1] * 2, "sum": float(seen.item()),
                    "host": socket.gethostname()}
        return super().generate(x)
