"""A worker class the ranks cannot find (issue 46, item 1): defined under the script's
``if __name__ == "__main__":`` guard it is a TypeError at construction (the script's
source tells it), defined where the ranks do not run for another reason it is the
rank's TypeError from ``start()``; each names the class, the script and the fix.  Each
case is a real script run as a user runs it (``python app.py``, ``python -m app``)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap

from docs_pages import REPO

from reactor_dist.main_guard import where_bound

FIX = ("Define the worker class at the top level of the script, above the guard (or in a "
       "module the script imports); keep only the code that builds and uses the runner "
       "under `if __name__ == \"__main__\":`")
TAIL = """
    with DistributedRunner(W, world_size=2, device="cpu", init_process_group=False,
                           start_timeout=60) as runner:
        print(runner.generate(1))
"""


def run(tmp_path, *args: str) -> subprocess.CompletedProcess:
    """``python <args>`` in ``tmp_path``, the checkout importable."""
    return subprocess.run([sys.executable, *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=REPO))


def last_line(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 1, out.stderr
    return out.stderr.strip().splitlines()[-1]


UNDER_GUARD = """
from reactor_dist import DistributedRunner, DistributedWorker

if __name__ == "__main__":
    class W(DistributedWorker):
        def generate(self, x):
            return x
""" + TAIL


def test_a_class_under_the_main_guard_is_refused_at_construction(tmp_path):
    (tmp_path / "app.py").write_text(UNDER_GUARD)
    script = str(tmp_path / "app.py")
    assert last_line(run(tmp_path, "app.py")) == (
        f"TypeError: worker class W is defined under `if __name__ == \"__main__\":` in "
        f"{script}, which the rank processes skip: each rank runs the script again (as "
        f"__mp_main__) to find the class, and the guard keeps that block from running "
        f"there. {FIX}")


def test_the_same_under_python_dash_m(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "app.py").write_text(UNDER_GUARD)
    assert last_line(run(tmp_path, "-m", "pkg.app")) == (
        f"TypeError: worker class W is defined under `if __name__ == \"__main__\":` in "
        f"{tmp_path / 'pkg' / 'app.py'}, which the rank processes skip: each rank runs "
        f"the script again (as __mp_main__) to find the class, and the guard keeps that "
        f"block from running there. {FIX}")


ELSEWHERE = """
from reactor_dist import DistributedRunner, DistributedWorker

if __name__ != "__mp_main__":  # true in the caller only: the source cannot tell
    class W(DistributedWorker):
        def generate(self, x):
            return x

if __name__ == "__main__":""" + TAIL


def test_a_class_the_ranks_skip_for_another_reason_fails_start_naming_it(tmp_path):
    (tmp_path / "app.py").write_text(ELSEWHERE)
    out = run(tmp_path, "app.py")
    assert last_line(out) == (
        f"TypeError: worker class W was not found when this rank ran your script "
        f"{tmp_path / 'app.py'} again (as __mp_main__) to find it: the script defines it "
        f"only where the ranks do not run, such as under `if __name__ == \"__main__\":` or "
        f"in a branch taken only in your process. {FIX}")
    assert "start()" in out.stderr  # raised by start(), after construction passed


def test_a_module_class_the_ranks_skip_fails_start_naming_its_module(tmp_path):
    (tmp_path / "models.py").write_text(textwrap.dedent("""
        import sys
        from reactor_dist import DistributedWorker

        if sys.argv[0].endswith("app.py"):  # the caller's script only
            class W(DistributedWorker):
                def generate(self, x):
                    return x
    """))
    source = "from models import W\nfrom reactor_dist import DistributedRunner\n" \
             "if __name__ == \"__main__\":" + TAIL
    (tmp_path / "app.py").write_text(source)
    assert last_line(run(tmp_path, "app.py")) == (
        "TypeError: worker class W was not found when this rank imported its module "
        "'models': the module defines it only where the ranks do not run (a branch taken "
        "only in your process?). Define it at the module's top level")


def test_a_class_at_the_top_level_beside_the_guard_runs(tmp_path):
    source = """
from reactor_dist import DistributedRunner, DistributedWorker

try:
    class W(DistributedWorker):
        def generate(self, x):
            return x
except ImportError:
    raise

if __name__ == "__main__":""" + TAIL
    (tmp_path / "app.py").write_text(source)
    out = run(tmp_path, "app.py")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1"


def test_where_a_name_is_bound():
    tree = ast.parse(textwrap.dedent("""
        import os as A
        if "__main__" == __name__:
            class B: pass
            C = 1
        else:
            D = 2
        if os.environ.get("X"):
            C = 3
        def f():
            E = 1
        with open("x") as g:
            class F: pass
    """))
    assert [where_bound(tree.body, n) for n in "ABCDEF"] == [
        {"top"}, {"guard"}, {"guard", "top"}, {"top"}, set(), {"top"}]
