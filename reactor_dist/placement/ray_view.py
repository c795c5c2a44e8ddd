"""What Ray shows: the cluster the runner joins, and what a Ray-placed rank sees (its
GPUs, its place on its node, its CPU threads).

The runner joins the cluster at RAY_ADDRESS, else the one ``ray start`` runs on this
machine ("auto"); where none runs it says so at once, with how to start one.

Ray narrows each GPU actor's ``CUDA_VISIBLE_DEVICES`` to the GPUs it assigned it, so a
rank of a ``{"GPU": n}`` bundle sees its own GPUs alone, as ``cuda:0`` .. ``cuda:n-1``.
What torchrun-style code derives from the environment must match that view:

- ``LOCAL_RANK`` is 0 and ``LOCAL_WORLD_SIZE`` 1 (``cuda:LOCAL_RANK`` is its GPU; the
  rank's index on its node would be an invalid ordinal on every rank above 0);
- the rank must see exactly the GPUs Ray gave it, none shared with another rank of the
  runner: a fractional ``GPU`` bundle (two ranks on one GPU, which NCCL refuses) or
  ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1`` (every rank sees the node's GPUs,
  so ``cuda:0`` is not its own) is refused at start, with what to change;
- ``OMP_NUM_THREADS`` is the runner's, as a local rank inherits it (or unset), never
  Ray's: Ray sets it to the actor's CPU count, at least 1, and a ``{"GPU": 1}`` host has
  ``num_cpus=0``, so the rank's CPU work would run on one thread.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

from ..errors import PlacementFailed

NOSET_ENV = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"
THREADS_ENV = "OMP_NUM_THREADS"


def connect(ray: Any, timeout: float) -> None:
    """ray.init to the running cluster (RAY_ADDRESS, else "auto"), or PlacementFailed at
    once where none runs: Ray itself would retry a closed RAY_ADDRESS for minutes."""
    address = os.environ.get("RAY_ADDRESS", "")
    where = f"RAY_ADDRESS={address}" if address else \
        'address "auto" (RAY_ADDRESS is not set, and no cluster runs on this machine)'
    fix = ("Start one on this machine with `ray start --head` (or set RAY_ADDRESS to a "
           "running cluster's address), or try it locally on a two-node cluster of "
           "ray.cluster_utils.Cluster (docs: \"More than one machine\"); nothing was started")
    host, _, port = address.split("://")[-1].rpartition(":")
    if host and port.isdigit():  # host:port or ray://host:port
        try:
            socket.create_connection((host.strip("[]"), int(port)), min(timeout, 5)).close()
        except OSError as exc:
            raise PlacementFailed(f'placement="ray" found no Ray cluster at {where} '
                                  f"({exc}). {fix}") from exc
    try:
        ray.init(address="auto", include_dashboard=False, logging_level=logging.WARNING)
    except ConnectionError as exc:  # Ray's "Could not find any running Ray instance"
        raise PlacementFailed(f'placement="ray" found no Ray cluster at {where}. {fix}'
                              ) from exc


def gpu_view() -> tuple[list[str], str | None]:
    """In a host: (the GPU ids Ray assigned it, the CUDA_VISIBLE_DEVICES it sees)."""
    import ray

    return [str(g) for g in ray.get_gpu_ids()], os.environ.get("CUDA_VISIBLE_DEVICES")


def check_own_gpus(views: list[tuple[int, str, list[str], str | None]]) -> None:
    """Refuse (PlacementFailed) unless each rank, given as ``(rank, node, Ray's GPU ids,
    its CUDA_VISIBLE_DEVICES)``, sees exactly its own GPUs and shares none."""
    owners: dict[tuple[str, str], int] = {}
    for rank, node, gpus, visible in views:
        if visible != ",".join(gpus):
            raise PlacementFailed(
                f"rank {rank} sees CUDA_VISIBLE_DEVICES="
                f"{'<unset: every GPU>' if visible is None else visible} but Ray gave it GPU "
                f"{','.join(gpus) or '<none>'}: Ray did not narrow its view ({NOSET_ENV} is "
                f"set on its node?), so cuda:0 would not be its GPU. Unset {NOSET_ENV} on "
                f"the cluster's nodes")
        for gpu in gpus:
            other = owners.setdefault((node, gpu), rank)
            if other != rank:
                raise PlacementFailed(
                    f"ranks {other} and {rank} share GPU {gpu} on node {node[:12]}: a "
                    f"fractional GPU in ray_bundle let Ray put two ranks on one GPU (NCCL "
                    f"refuses that, and their memory would collide). Give each rank whole "
                    f"GPUs, e.g. ray_bundle={{'GPU': 1}}")


def local_place(rank: int, nodes: list[str], own_gpus: bool) -> tuple[int, int]:
    """(LOCAL_RANK, LOCAL_WORLD_SIZE) of ``rank`` (``nodes``: each rank's node): with
    GPUs of its own it is alone in what it sees; else its index among its node's ranks."""
    if own_gpus:
        return 0, 1
    same_node = [r for r, node in enumerate(nodes) if node == nodes[rank]]
    return same_node.index(rank), len(same_node)


def set_rank_threads(threads: str | None) -> None:
    """In a host, before it starts its rank: the runner's OMP_NUM_THREADS (``threads``),
    or none, in place of the one Ray set for the actor."""
    if threads is None:
        os.environ.pop(THREADS_ENV, None)
    else:
        os.environ[THREADS_ENV] = threads
