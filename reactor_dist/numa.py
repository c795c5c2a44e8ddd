"""``python -m reactor_dist.numa RANK CMD...``: run CMD on the CPUs of rank RANK's GPU's
NUMA node, as a ``launch_prefix``::

    launch_prefix=[sys.executable, "-m", "reactor_dist.numa", "{rank}"]

``numactl --cpunodebind={rank}`` would name node 5 for rank 5, which a 2-socket, 8-GPU
machine does not have: a GPU's node is where its PCI device sits.  The rank's GPU is the
``RANK``-th CUDA device this process sees, and its PCI device is the one whose bus id
CUDA's driver reports for it (``cuDeviceGetPCIBusId``: right inside a container given
some GPUs with ``--gpus``, where sysfs still lists every GPU of the machine).  Without the
driver's library, the GPU is the ``RANK``-th of ``CUDA_VISIBLE_DEVICES`` (numbers) or,
unset, GPU ``RANK``, NVIDIA devices counted in PCI bus order (``nvidia-smi``'s;
``CUDA_DEVICE_ORDER=PCI_BUS_ID`` makes CUDA's the same).  The node is the device's
``numa_node`` in sysfs.  Where that cannot
be found (no NVIDIA device, a machine without NUMA: ``-1``), CMD runs unbound, with a
note on stderr.  Memory follows the CPUs by first touch.
"""

from __future__ import annotations

import ctypes
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


def bus_id(text: str) -> str | None:
    """CUDA's PCI bus id ("0000:3B:00.0", or NVML's 8-digit domain) as sysfs names the
    device ("0000:3b:00.0"); None where it is no such id."""
    try:
        domain, bus, rest = text.strip().split(":")
        device, function = rest.split(".")
        return f"{int(domain, 16):04x}:{int(bus, 16):02x}:{int(device, 16):02x}." \
               f"{int(function, 16):x}"
    except ValueError:
        return None


def cuda_bus_id(index: int) -> str | None:
    """The PCI bus id CUDA's driver reports for its ``index``-th visible device (honouring
    CUDA_VISIBLE_DEVICES, UUIDs too); None without the driver or such a device.  The
    driver API alone: no runtime context is made, and CMD gets the GPU as it was."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    handle, text = ctypes.c_int(), ctypes.create_string_buffer(64)
    if driver.cuInit(0) != 0 or driver.cuDeviceGet(ctypes.byref(handle), index) != 0 or \
            driver.cuDeviceGetPCIBusId(text, len(text), handle) != 0:
        return None
    return bus_id(text.value.decode(errors="replace"))


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
    found = cuda_bus_id(rank)
    device = os.path.join(sysfs(), "bus", "pci", "devices", found) if found else ""
    if device and os.path.isdir(device):
        try:
            node = int(read(os.path.join(device, "numa_node")))
        except (OSError, ValueError):
            node = -1
        if node < 0:
            return None, f"CUDA device {rank} ({found}) has no NUMA node"
        return node, ""
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
