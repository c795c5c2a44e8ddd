"""The wheel installs the ``reactor_dist`` package alone (with its ``py.typed``).

The example models in the checkout's ``workers/`` must not become a top-level package
named ``workers`` in site-packages.  The wheel is built offline from a copy of the
sources (no index, no build isolation: the environment's own setuptools), so that the
build leaves nothing in the checkout.

The Makefile installs Ray only for the targets that use it (``make -n``, nothing run).
"""

from __future__ import annotations

import os
import pathlib
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
    assert "reactor-dist-rank = reactor_dist.rank.server:main" in scripts  # the rank script
    assert "reactor-dist-worker = reactor_dist.rank.server:main" in scripts  # deprecated alias
    # every folder of the package, each with its modules
    source = pathlib.Path(REPO, "reactor_dist")
    expected = {str(p.relative_to(source.parent)) for p in source.rglob("*.py")}
    assert expected <= set(names), sorted(expected - set(names))


def make_dry_run(target: str, venv: str) -> list[str]:
    """The commands ``make <target>`` would run for a venv that does not exist yet
    (``make -n``: printed, none run), with a recognisable RAY_SPEC."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    out = subprocess.run(["make", "-n", target, f"VENV={venv}",
                          "RAY_SPEC=the-ray-spec"], cwd=REPO, capture_output=True, text=True,
                         timeout=60, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout.splitlines()


@pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")
def test_make_installs_ray_only_for_the_targets_that_use_it(tmp_path):
    venv = str(tmp_path / "fresh-venv")  # absent: make shows every install step
    py = f"{venv}/bin/python"

    def installs_ray(lines: list[str]) -> bool:
        return any("the-ray-spec" in line or "import ray" in line or '".[ray]"' in line
                   for line in lines)

    demo = make_dry_run("demo", venv)
    assert f'{py} -m pip install -q -e ".[dev,metrics]"' in demo  # the base venv
    assert demo[-1] == f"{py} examples/demo.py --world-size 2 --device auto"
    assert not installs_ray(demo), "\n".join(demo)
    for target in ("lint", "stress", "bench-per-call"):
        assert not installs_ray(make_dry_run(target, venv)), target
    for target in ("test", "test-slow", "bench", "bench-quick"):
        lines = make_dry_run(target, venv)
        assert f'{py} -c "import ray" 2>/dev/null || {py} -m pip install -q the-ray-spec' \
            in lines, target
        assert f'{py} -m pip install -q -e ".[ray]"' in lines, target
        assert f"touch {venv}/.ray-installed" in lines, target
    assert not os.path.exists(venv)  # a dry run
