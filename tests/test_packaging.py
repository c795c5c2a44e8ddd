"""The wheel installs the ``reactor_dist`` package alone (with its ``py.typed``).

The example models in the checkout's ``workers/`` must not become a top-level package
named ``workers`` in site-packages.  The wheel is built offline from a copy of the
sources (no index, no build isolation: the environment's own setuptools), so that the
build leaves nothing in the checkout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_wheel_holds_reactor_dist_alone(tmp_path):
    pytest.importorskip("setuptools", minversion="77")  # what pyproject.toml's build needs
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(REPO, name), src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("reactor_dist", "workers"):  # workers/ is there, and must stay out
        shutil.copytree(os.path.join(REPO, name), src / name, ignore=ignore)
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-index", "-v", "-w", str(tmp_path / "dist"), str(src)],
        capture_output=True, text=True, timeout=120,
        env=dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "deprecated" not in out.stdout + out.stderr, out.stdout + out.stderr
    (wheel,) = (tmp_path / "dist").iterdir()
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        metadata = zf.read("reactor_dist-0.1.0.dist-info/METADATA").decode()
        scripts = zf.read("reactor_dist-0.1.0.dist-info/entry_points.txt").decode()
    tops = {name.split("/", 1)[0] for name in names}
    assert tops == {"reactor_dist", "reactor_dist-0.1.0.dist-info"}, sorted(names)
    assert "reactor_dist/py.typed" in names and "reactor_dist/__init__.py" in names
    assert "License-Expression: Apache-2.0" in metadata
    assert "reactor-dist = reactor_dist.__main__:main" in scripts
    assert "reactor-dist-rank = reactor_dist.rank:main" in scripts
    assert "reactor-dist-worker = reactor_dist.rank:main" in scripts  # the former name
