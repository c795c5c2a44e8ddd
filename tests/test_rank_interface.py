"""One interface for a rank wherever it runs (issue 30, item 4): a local process
(local.RankProcess) and a Ray-hosted rank (ray_group.HostedRank) are both a
base.Rank, the two placements (local.LocalPlacement, ray_group.RayGroup) both a
base.Placement, and the supervisor asks them without ever asking which one it has.
"""

from __future__ import annotations

import ast
import inspect
import pathlib
import signal

import pytest
from probe import Probe
from sample_workers import Echo, Sleep

import reactor_dist
from reactor_dist import DistributedRunner, WorkerCrashed
from reactor_dist.placement.base import Placement, Rank
from reactor_dist.placement.local import LocalPlacement, RankProcess
from reactor_dist.placement.ray_group import HostedRank, RayGroup

PACKAGE = pathlib.Path(reactor_dist.__file__).parent
# The names of the placements' own classes and options: a module that names one of them
# chooses between placements.
PLACEMENT_NAMES = {"RankProcess", "HostedRank", "LocalPlacement", "RayGroup", "RaySpec",
                   "placement_for", "check_ray_options"}


@pytest.mark.parametrize("handle, interface", [
    (RankProcess, Rank), (HostedRank, Rank), (LocalPlacement, Placement), (RayGroup, Placement),
])
def test_each_placement_implements_the_whole_interface(handle, interface):
    assert issubclass(handle, interface)
    assert not inspect.isabstract(handle), sorted(handle.__abstractmethods__)


def test_the_interfaces_are_abstract():
    for interface in (Rank, Placement):
        assert inspect.isabstract(interface)
        with pytest.raises(TypeError):
            interface()


def placement_branches(source: str) -> list[str]:
    """Where a module asks which placement it has, as ``line: what``: reads a ``hosted``
    flag or the Ray options (``_ray``), compares a placement with None, tests a handle's
    or a placement's class, or names a placement's own class."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in ("hosted", "_ray"):
            found.append(f"{node.lineno}: reads .{node.attr}")
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(isinstance(s, ast.Constant) and s.value is None for s in sides) and any(
                    "placement" in ast.unparse(s) for s in sides):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Name) and node.id in PLACEMENT_NAMES:
            found.append(f"{node.lineno}: names {node.id}")
        elif isinstance(node, ast.ImportFrom):
            found.extend(f"{node.lineno}: imports {a.name}" for a in node.names
                         if a.name in PLACEMENT_NAMES)
            if node.module in ("placement.ray_group", "placement.ray_host", "ray_group",
                               "ray_host"):
                found.append(f"{node.lineno}: imports from {node.module}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("isinstance", "issubclass") and len(node.args) == 2
              and {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
              & (PLACEMENT_NAMES | {"Rank", "Placement"})):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_supervisor_never_asks_where_a_rank_runs():
    source = (PACKAGE / "caller" / "supervisor.py").read_text()
    assert placement_branches(source) == [], (
        "supervisor.py asks which placement it has; ask the placement "
        "(base.Placement) or the rank's handle (base.Rank) instead")


@pytest.mark.parametrize("source, found", [
    ("if proc.hosted:\n    pass", ["1: reads .hosted"]),
    ("if self._ray is None:\n    pass", ["1: reads ._ray"]),
    ("if self.placement is not None:\n    pass", ["1: self.placement is not None"]),
    ("ok = isinstance(proc, Rank)", ["1: isinstance(proc, Rank)"]),
    ("from ..placement.ray_group import RayGroup",
     ["1: imports RayGroup", "1: imports from placement.ray_group"]),
    ("group = RayGroup(2)", ["1: names RayGroup"]),
    ("ok = isinstance(seconds, float)\nself.placement.start(ranks)", []),
])
def test_a_branch_on_the_placement_is_found(source, found):
    assert placement_branches(source) == found


def test_no_module_reads_a_hosted_flag():
    readers = [f"{path.name}:{line}" for path in sorted(PACKAGE.rglob("*.py"))
               for line in placement_branches(path.read_text()) if "reads .hosted" in line]
    assert readers == []


def test_a_local_rank_signalled_through_its_handle_is_a_crash_with_its_signal():
    with DistributedRunner(Echo, world_size=2, device="cpu", init_process_group=False,
                           call_timeout=60) as runner:
        probe = Probe(runner)
        pid = probe.rank_pids[1]
        probe.signal_rank(1, signal.SIGKILL)
        with pytest.raises(WorkerCrashed, match=r"rank 1 .*SIGKILL") as info:
            runner.generate(Sleep(30))
        (failure,) = info.value.failures
        assert (failure.rank, failure.pid, failure.signal) == (1, pid, signal.SIGKILL)
