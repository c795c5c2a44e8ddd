"""``python -m reactor_dist.numa RANK CMD...``: run CMD on the CPUs of rank RANK's GPU's
NUMA node, as a ``launch_prefix``::

    launch_prefix=[sys.executable, "-m", "reactor_dist.numa", "{rank}"]

``numactl --cpunodebind={rank}`` would name node 5 for rank 5, which a 2-socket, 8-GPU
machine does not have: a GPU's node is where its PCI device sits.  The rank's GPU is the
``RANK``-th of ``CUDA_VISIBLE_DEVICES`` (numbers) or, unset, GPU ``RANK``; NVIDIA devices
are counted in PCI bus order (``nvidia-smi``'s; ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` makes
CUDA's the same), and the node is the device's ``numa_node`` in sysfs.  Where that cannot
be found (no NVIDIA device, a machine without NUMA: ``-1``), CMD runs unbound, with a
note on stderr.  Memory follows the CPUs by first touch.
"""

from __future__ import annotations

import os
import sys

NVIDIA = "0x10de"
GPU_CLASSES = ("0x0300", "0x0302")  # VGA controller, 3D controller
SYSFS_ENV = "REACTOR_DIST_SYSFS"  # another root than /sys (the tests' machines)


def sysfs() -> str:
    return os.environ.get(SYSFS_ENV, "/sys")


def read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def nvidia_gpus() -> list[str]:
    """The PCI directories of the NVIDIA GPUs, in PCI bus order."""
    root = os.path.join(sysfs(), "bus", "pci", "devices")
    found = []
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        try:
            if read(os.path.join(root, name, "vendor")) == NVIDIA and \
                    read(os.path.join(root, name, "class"))[:6] in GPU_CLASSES:
                found.append(os.path.join(root, name))
        except OSError:
            continue
    return found


def physical_gpu(rank: int) -> int | None:
    """The physical index of ``rank``'s GPU; None where CUDA_VISIBLE_DEVICES does not say
    (UUIDs, too few entries)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return rank
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if rank < len(entries) and entries[rank].isdigit():
        return int(entries[rank])
    return None


def node_cpus(node: int) -> set[int]:
    """The CPUs of NUMA node ``node`` (its cpulist: "0-3,8-11")."""
    cpus: set[int] = set()
    for part in read(os.path.join(sysfs(), "devices", "system", "node", f"node{node}",
                                  "cpulist")).split(","):
        first, _, last = part.partition("-")
        if first:
            cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def gpu_node(rank: int) -> tuple[int | None, str]:
    """``rank``'s GPU's NUMA node, or None and why not."""
    gpu = physical_gpu(rank)
    if gpu is None:
        return None, f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r} " \
                     f"names no GPU number for rank {rank}"
    gpus = nvidia_gpus()
    if gpu >= len(gpus):
        return None, f"GPU {gpu} not found ({len(gpus)} NVIDIA GPUs in sysfs)"
    try:
        node = int(read(os.path.join(gpus[gpu], "numa_node")))
    except (OSError, ValueError):
        node = -1
    if node < 0:
        return None, f"GPU {gpu} ({os.path.basename(gpus[gpu])}) has no NUMA node"
    return node, ""


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2 or not args[0].isdigit():
        print("usage: python -m reactor_dist.numa RANK CMD... (as a launch_prefix: "
              "[sys.executable, '-m', 'reactor_dist.numa', '{rank}'])", file=sys.stderr)
        return 2
    rank, cmd = int(args[0]), args[1:]
    node, why = gpu_node(rank)
    cpus = set() if node is None else node_cpus(node) & os.sched_getaffinity(0)
    if node is not None and not cpus:
        why = f"no CPU of NUMA node {node} is allowed to this process (a cpuset?)"
    if cpus:
        os.sched_setaffinity(0, cpus)
    else:
        print(f"reactor_dist.numa: rank {rank} runs unbound: {why}", file=sys.stderr)
    os.execvp(cmd[0], cmd)
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())
