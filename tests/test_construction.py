"""Everything DistributedRunner() checks at construction, before any process exists."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import types

import psutil
import pytest
from conftest import templates
from sample_workers import Echo, NoMethods, OnlyLoad

from reactor_dist import DistributedRunner, DistributedWorker


def no_children() -> bool:
    """No process but the rank templates, which earlier tests' runners started and which
    serve every runner of this process (reactor_dist.placement.template)."""
    own = templates()
    return [p for p in psutil.Process().children(recursive=True) if p.pid not in own] == []


@pytest.mark.parametrize("bad", [0, -1, 1.0, 2.5, "2", True, False, None])
def test_world_size_must_be_a_positive_int(bad):
    expected = r"world_size must be a positive int.*" + type(bad).__name__
    with pytest.raises(ValueError, match=expected):
        DistributedRunner(Echo, world_size=bad)
    assert no_children()


def test_missing_methods_are_each_named():
    with pytest.raises(TypeError) as info:
        DistributedRunner(NoMethods)
    assert "missing load, generate, reset" in str(info.value)
    with pytest.raises(TypeError, match=r"OnlyLoad is missing generate, reset"):
        DistributedRunner(OnlyLoad)


def test_base_class_generate_does_not_count():
    class_ = type("Bare", (DistributedWorker,), {"__module__": "sample_workers"})
    with pytest.raises(TypeError, match="missing generate"):
        DistributedRunner(class_)


def test_not_a_class():
    with pytest.raises(TypeError, match="must be a class"):
        DistributedRunner(Echo())


def test_local_class_is_refused_with_the_fix():
    class Local(DistributedWorker):
        def generate(self, x):
            return x

    with pytest.raises(TypeError, match="defined inside a function.*top level of a module"):
        DistributedRunner(Local)
    assert no_children()


def test_notebook_class_is_refused_with_the_fix(monkeypatch):
    fake_main = types.ModuleType("__main__")  # an interactive session: no __file__
    monkeypatch.setitem(sys.modules, "__main__", fake_main)
    cls = type("CellWorker", (DistributedWorker,), {"generate": lambda self, x: x,
                                                     "__module__": "__main__"})
    fake_main.CellWorker = cls
    with pytest.raises(TypeError, match="interactive session or notebook.*\\.py module"):
        DistributedRunner(cls)


def test_unreachable_class_is_refused():
    cls = type("Ghost", (DistributedWorker,), {"generate": lambda self, x: x,
                                                "__module__": "sample_workers"})
    with pytest.raises(TypeError, match="not reachable as sample_workers.Ghost"):
        DistributedRunner(cls)


def test_unpicklable_load_kwarg_is_named():
    with pytest.raises(TypeError, match=r"load_kwargs\['lock'\] cannot be pickled"):
        DistributedRunner(Echo, load_kwargs={"log_dir": None, "lock": threading.Lock()})
    assert no_children()


@pytest.mark.parametrize("kwargs, message", [
    ({"call_timeout": 0}, "call_timeout must be a positive"),
    ({"start_timeout": -1}, "start_timeout must be a positive"),
    ({"device": "tpu"}, "device must be"),
    ({"world_size": 2, "gpus": [0]}, "one GPU per rank"),
])
def test_bad_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DistributedRunner(Echo, **kwargs)


def test_calls_before_start_and_second_start():
    runner = DistributedRunner(Echo, init_process_group=False, device="cpu")
    with pytest.raises(RuntimeError, match=r"start\(\) has not run"):
        runner.generate(1)
    with pytest.raises(RuntimeError, match=r"start\(\) has not run"):
        runner.reset()
    assert not runner.healthy
    runner.start()
    try:
        with pytest.raises(RuntimeError, match="starts once"):
            runner.start()
        assert runner.healthy
    finally:
        runner.shutdown()
    assert not runner.healthy
    with pytest.raises(RuntimeError, match="unusable"):
        runner.generate(1)
    runner.shutdown()  # idempotent


# The rank's entry points: the module, the installed script, and the script's former name.
RANK_ENTRIES = [[sys.executable, "-m", "reactor_dist.rank"],
                [os.path.join(os.path.dirname(sys.executable), "reactor-dist-rank")],
                [os.path.join(os.path.dirname(sys.executable), "reactor-dist-worker")]]


@pytest.mark.parametrize("entry", RANK_ENTRIES, ids=["module", "script", "former-script"])
def test_rank_entry_point_help(entry):
    out = subprocess.run([*entry, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    assert "reactor-dist-rank" in out.stdout and "launch_prefix" in out.stdout


@pytest.mark.parametrize("entry", RANK_ENTRIES, ids=["module", "script", "former-script"])
def test_rank_entry_point_refuses_to_run_without_bootstrap(entry):
    out = subprocess.run(entry, input=b"", capture_output=True, timeout=60)
    assert out.returncode != 0
    assert b"started by DistributedRunner" in out.stderr


def test_the_runner_docstring_describes_every_constructor_option_in_order():
    """The API page (mkdocstrings) shows each option with its default from these."""
    import inspect
    import re

    options = list(inspect.signature(DistributedRunner.__init__).parameters)[1:]
    assert re.findall(r":param (\w+):", DistributedRunner.__doc__ or "") == options


def test_two_ranks_on_one_gpu_are_refused_and_a_spare_may_share_a_ranks_gpu():
    """NCCL allows one rank per GPU: gpus naming one twice among the ranks' entries is
    refused here, not as start()'s "torch sees no CUDA device"; a spare's entry may
    repeat a rank's (issue 43, item 6)."""
    with pytest.raises(ValueError) as refused:
        DistributedRunner(Echo, world_size=2, gpus=[0, 0])
    assert str(refused.value) == (
        "gpus=[0, 0] puts ranks 0 and 1 on GPU 0, but NCCL allows one rank per GPU: give "
        "each of the 2 ranks a GPU of its own (the first 2 entries of gpus distinct), or "
        "lower world_size; a spare, named after the ranks, may share a rank's GPU "
        "(gpus=[0, 1, 0] with world_size=2, spares=1: the spare waits on GPU 0)")
    with pytest.raises(ValueError, match=r"^gpus=\[3, 5, 5\] puts ranks 1 and 2 on GPU 5, "):
        DistributedRunner(Echo, world_size=3, gpus=[3, 5, 5])
    from restart_workers import ReducesAndRejoins
    runner = DistributedRunner(ReducesAndRejoins, world_size=2, spares=1, gpus=[0, 1, 0])
    assert runner.world_size == 2
    assert no_children()
