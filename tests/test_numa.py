"""``python -m reactor_dist.numa``: the docs' launch_prefix that binds each rank to the
CPUs of its GPU's NUMA node, on a machine's sysfs laid out in a directory."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from docs_pages import examples
from numa_workers import CpuAffinity

from reactor_dist import DistributedRunner
from reactor_dist.numa import SYSFS_ENV

ALLOWED = sorted(os.sched_getaffinity(0))
FIRST, LAST = ALLOWED[0], ALLOWED[-1]
SHOW_CPUS = [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"]


@pytest.fixture
def two_socket_eight_gpus(tmp_path):
    """A 2-socket machine's sysfs: GPUs 0-3 on node 0 (CPU FIRST), 4-7 on node 1 (CPU
    LAST), and a network card in between that is no GPU."""
    devices = tmp_path / "bus" / "pci" / "devices"
    buses = ["0000:18:00.0", "0000:2a:00.0", "0000:3a:00.0", "0000:5d:00.0",
             "0000:9a:00.0", "0000:ab:00.0", "0000:ba:00.0", "0000:db:00.0"]
    layout = [(bus, "0x10de", "0x030200", str(i // 4)) for i, bus in enumerate(buses)]
    layout.append(("0000:3b:00.0", "0x15b3", "0x020700", "0"))  # a NIC, not counted
    for bus, vendor, klass, node in layout:
        (devices / bus).mkdir(parents=True)
        for name, value in (("vendor", vendor), ("class", klass), ("numa_node", node)):
            (devices / bus / name).write_text(value + "\n")
    for node, cpu in ((0, FIRST), (1, LAST)):
        (tmp_path / "devices" / "system" / "node" / f"node{node}").mkdir(parents=True)
        (tmp_path / "devices" / "system" / "node" / f"node{node}" / "cpulist").write_text(
            f"{cpu}\n")
    return str(tmp_path)


def launch(*args: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    return subprocess.run([sys.executable, "-m", "reactor_dist.numa", *args, *SHOW_CPUS],
                          capture_output=True, text=True, timeout=60, env={**clean, **env})


def test_each_rank_gets_its_gpus_node_not_the_node_named_by_its_rank(two_socket_eight_gpus):
    fake = {SYSFS_ENV: two_socket_eight_gpus}
    assert launch("5", **fake).stdout == f"[{LAST}]\n"   # GPU 5 sits on node 1
    assert launch("3", **fake).stdout == f"[{FIRST}]\n"  # GPU 3 on node 0
    # gpus=[6, 1] sets CUDA_VISIBLE_DEVICES: rank 1's GPU is physical GPU 1, on node 0
    assert launch("1", CUDA_VISIBLE_DEVICES="6,1", **fake).stdout == f"[{FIRST}]\n"
    assert launch("0", CUDA_VISIBLE_DEVICES="6,1", **fake).stdout == f"[{LAST}]\n"


def test_without_a_node_the_rank_runs_unbound_and_says_why(two_socket_eight_gpus):
    out = launch("8", **{SYSFS_ENV: two_socket_eight_gpus})  # a ninth GPU: none
    assert out.stdout == f"{ALLOWED}\n"
    assert out.stderr == ("reactor_dist.numa: rank 8 runs unbound: GPU 8 not found "
                          "(8 NVIDIA GPUs in sysfs)\n")
    out = launch("0", CUDA_VISIBLE_DEVICES="GPU-5e1f", **{SYSFS_ENV: two_socket_eight_gpus})
    assert out.stdout == f"{ALLOWED}\n" and "names no GPU number for rank 0" in out.stderr
    bad = subprocess.run([sys.executable, "-m", "reactor_dist.numa", "x"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "usage: python -m reactor_dist.numa RANK CMD" in bad.stderr


def test_the_docs_numa_launch_prefix_binds_each_rank(two_socket_eight_gpus, monkeypatch):
    (block,) = examples("docs/bring-your-own-model.md", "Binding each rank to its GPU's NUMA node")
    scope: dict = {}
    exec(block, scope)  # the page's block as printed
    # ranks 0 and 1 on GPUs 3 and 4: one on each socket
    monkeypatch.setenv(SYSFS_ENV, two_socket_eight_gpus)
    with DistributedRunner(CpuAffinity, world_size=2, device="cpu", gpus=[3, 4],
                           launch_prefix=scope["launch_prefix"]) as runner:
        assert runner.generate(None) == [[FIRST], [LAST]]


def test_cudas_pci_bus_id_is_read_as_sysfs_names_the_device():
    """Issue 54: the GPU's PCI device is the one CUDA's driver names (right inside a
    container given some GPUs, where sysfs order is not CUDA's); its id in either of
    the driver's spellings maps to sysfs's directory name, anything else to None."""
    from reactor_dist.numa import bus_id, cuda_bus_id

    assert bus_id("0000:3B:00.0") == "0000:3b:00.0"
    assert bus_id("00000000:DB:00.0") == "0000:db:00.0"
    assert bus_id("GPU-5c1e") is None and bus_id("") is None
    if not os.path.exists("/dev/nvidiactl"):
        assert cuda_bus_id(0) is None  # no driver here: the sysfs order is the fallback
