"""The README's quickstart runs as printed."""

from __future__ import annotations

import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_block(heading: str) -> str:
    with open(os.path.join(REPO, "README.md")) as f:
        text = f.read()
    section = text.split(f"## {heading}\n", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_quickstart_runs_as_printed(tmp_path):
    (tmp_path / "quickstart.py").write_text(readme_block("Quickstart"))
    out = subprocess.run([sys.executable, "quickstart.py"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=180, env=dict(os.environ, PYTHONPATH=REPO))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "2.0"
