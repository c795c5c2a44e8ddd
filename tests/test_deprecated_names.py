"""Former public names keep working, with a DeprecationWarning that names the new one."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import reactor_dist
from reactor_dist import SharedMemoryExhausted, errors

NEW_NAME = "SharedSlotAllocationFailed is deprecated: use SharedMemoryExhausted (the same class)"


@pytest.mark.parametrize("module", [reactor_dist, errors], ids=["package", "errors"])
def test_shared_slot_allocation_failed_is_the_segment_error_with_a_warning(module):
    with pytest.warns(DeprecationWarning, match=r"^" + NEW_NAME.replace("(", r"\(")
                      .replace(")", r"\)") + "$"):
        old = module.SharedSlotAllocationFailed
    assert old is SharedMemoryExhausted


def test_an_unknown_name_is_still_an_attribute_error():
    with pytest.raises(AttributeError, match="module 'reactor_dist' has no attribute 'Nope'"):
        reactor_dist.Nope  # noqa: B018


def test_star_import_takes_no_deprecated_name():
    assert "SharedSlotAllocationFailed" not in reactor_dist.__all__


OLD_CATCH = textwrap.dedent("""
    import os, warnings
    import numpy as np
    from reactor_dist import DistributedRunner
    from reactor_dist.shm import segments
    warnings.simplefilter("error", DeprecationWarning)
    try:
        from reactor_dist import SharedSlotAllocationFailed
    except DeprecationWarning as w:
        print("WARNED", w)
    warnings.simplefilter("ignore", DeprecationWarning)
    from reactor_dist import SharedSlotAllocationFailed
    from sample_workers import Echo
    os.environ[segments.LIMIT_ENV] = str(16 << 20)
    with DistributedRunner(Echo, world_size=2, init_process_group=False,
                           device="cpu", shm_dir=os.environ["SHM_DIR"]) as runner:
        try:
            runner.generate(np.zeros(20 << 20, np.uint8))
        except SharedSlotAllocationFailed as exc:
            print("CAUGHT", type(exc).__name__, runner.healthy)
""")


def test_code_written_against_the_old_name_still_catches_the_error(tmp_path):
    """An application's ``except SharedSlotAllocationFailed`` catches a real refusal."""
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    (tmp_path / "app.py").write_text(OLD_CATCH)
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run([sys.executable, "app.py"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120,
                         env={**os.environ, "SHM_DIR": str(shm_dir),
                              "PYTHONPATH": tests_dir})
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [f"WARNED {NEW_NAME}", "CAUGHT SharedMemoryExhausted True"]
