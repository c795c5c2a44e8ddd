"""More CPU ranks than cores: the runner says so at construction (issue 23), before the
slow start that a newcomer met in silence (8 ranks on 2 cores: 11.8 s).  No rank starts
here: the warning comes before any process exists."""

from __future__ import annotations

import importlib.util
import logging
import os

import pytest
from sample_workers import Echo

from reactor_dist import DistributedRunner
from reactor_dist.device import maybe_cuda

CORES = len(os.sched_getaffinity(0))


def warnings_of(caplog: pytest.LogCaptureFixture, **options) -> list[str]:
    caplog.clear()
    runner = DistributedRunner(Echo, init_process_group=False, **options)
    runner.shutdown()
    return [r.getMessage() for r in caplog.records
            if r.name == "reactor_dist" and r.levelno == logging.WARNING]


def test_more_cpu_ranks_than_cores_warns_at_construction_with_the_numbers(caplog):
    caplog.set_level(logging.WARNING, logger="reactor_dist")
    s = "s" if CORES != 1 else ""
    assert warnings_of(caplog, world_size=CORES + 1, device="cpu") == [
        f"world_size={CORES + 1}: the {CORES + 1} ranks will compute on the CPU, but this "
        f"process may use {CORES} CPU core{s}, so every rank's calls will share them (a slow "
        f"start, slow calls). Pass world_size={CORES} or less, or run the ranks on GPUs "
        f"(device=\"cuda\")"]
    assert warnings_of(caplog, world_size=CORES, device="cpu") == []  # a core per rank


@pytest.mark.skipif(maybe_cuda(), reason="with an NVIDIA driver 'auto' may mean GPUs")
def test_device_auto_without_a_driver_counts_as_cpu(caplog):
    caplog.set_level(logging.WARNING, logger="reactor_dist")
    (message,) = warnings_of(caplog, world_size=CORES + 1)  # device="auto", the default
    assert message.startswith(f"world_size={CORES + 1}: the {CORES + 1} ranks will compute "
                              f"on the CPU")


def test_no_warning_where_the_ranks_compute_elsewhere(caplog):
    caplog.set_level(logging.WARNING, logger="reactor_dist")
    assert warnings_of(caplog, world_size=CORES + 1, device="cuda") == []  # on GPUs
    if importlib.util.find_spec("ray") is not None:  # make test has the ray extra
        # placement="ray": the ranks run on the cluster's nodes, not on these cores.
        assert warnings_of(caplog, world_size=CORES + 1, device="cpu", placement="ray") == []
