"""placement="ray" where no Ray cluster runs: a clear error at once, nothing started.

Apart from tests/test_ray.py, whose module-wide cluster would be found.  RAY_ADDRESS
points at a loopback port that is bound but not listening: connecting is refused at
once, and no other process can listen there meanwhile.
"""

from __future__ import annotations

import socket

import pytest
from sample_workers import Echo

from reactor_dist import DistributedRunner, PlacementFailed

ray = pytest.importorskip("ray", reason="placement tests need the ray extra (make test has it)")


@pytest.fixture
def closed_port():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # bound, never listening: connect() is refused
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()


def test_no_cluster_at_ray_address_is_a_placement_error_saying_how_to_start_one(
        closed_port, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{closed_port}")
    assert not ray.is_initialized()
    runner = DistributedRunner(Echo, world_size=2, device="cpu", placement="ray",
                               init_process_group=False, start_timeout=20)
    with pytest.raises(PlacementFailed) as info:
        runner.start()
    assert str(info.value) == (
        f'placement="ray" found no Ray cluster at RAY_ADDRESS=127.0.0.1:{closed_port} '
        f"([Errno 111] Connection refused). Start one on this machine with `ray start "
        f"--head` (or set RAY_ADDRESS to a running cluster's address), or try it locally on "
        f'a two-node cluster of ray.cluster_utils.Cluster (docs: "More than one machine"); '
        f"nothing was started")
    assert isinstance(info.value.__cause__, ConnectionRefusedError)
    assert not ray.is_initialized() and not runner.healthy
    runner.shutdown()  # nothing to end; conftest checks no process, segment or ipc dir is left
