"""Workers for the group tests: each rank reports the torch.distributed group it got."""

from __future__ import annotations

from reactor_dist import DistributedWorker


def group_timeout_seconds() -> float:
    """The default group's timeout as torch keeps it (its CPU backend's options)."""
    import torch
    import torch.distributed as dist

    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    return backend.options._timeout.total_seconds()


class GroupProbe(DistributedWorker):
    """generate() returns every rank's group (all_gathered, rank order): its backend
    string, its timeout during load() and its timeout now."""

    def load(self) -> None:
        self.load_timeout = group_timeout_seconds()

    def generate(self, _, /):
        import torch.distributed as dist

        mine = {"backend": str(dist.get_backend()), "load_timeout": self.load_timeout,
                "timeout": group_timeout_seconds()}
        every: list = [None] * self.world_size
        dist.all_gather_object(every, mine)
        return every
