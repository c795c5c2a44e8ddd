"""The code blocks of README.md and docs/**/*.md, by page and heading, and how the tests
run one as printed (tests/test_docs_examples.py holds the rule and the table)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import NamedTuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FRAGMENT = "<!-- fragment -->"
# Fences in these languages are examples: each runs in the tests or is marked a fragment.
EXAMPLE_LANGUAGES = ("python", "bash", "sh", "shell", "console")
FENCE = re.compile(r"^```(\S*)\s*$")
HEADING = re.compile(r"^(#{1,6}) +(.+?)(?: +\{#[^}]*\})? *$")


class Block(NamedTuple):
    page: str  # relative to the repository root, e.g. "docs/streaming.md"
    heading: str  # the nearest heading above the block, without its #s
    language: str  # "" for a fence without one
    code: str
    fragment: bool  # preceded by the fragment marker
    line: int  # of its opening fence, 1-based


def pages() -> list[str]:
    found = ["README.md"]
    for root, _, files in os.walk(os.path.join(REPO, "docs")):
        found += [os.path.relpath(os.path.join(root, f), REPO) for f in files if f.endswith(".md")]
    return sorted(found)


def blocks(page: str) -> list[Block]:
    with open(os.path.join(REPO, page)) as f:
        lines = f.read().splitlines()
    found, heading, previous, i = [], "", "", 0
    while i < len(lines):
        line = lines[i]
        fence = FENCE.match(line)
        if fence:
            end = i + 1
            while end < len(lines) and not lines[end].startswith("```"):
                end += 1
            code = "\n".join(lines[i + 1:end]) + "\n"
            found.append(Block(page, heading, fence.group(1), code, previous == FRAGMENT, i + 1))
            i, previous = end + 1, ""
            continue
        match = HEADING.match(line)
        if match:
            heading = match.group(2).strip()
        if line.strip():
            previous = line.strip()
        i += 1
    return found


def examples(page: str, heading: str) -> list[str]:
    """The code of the examples (not fragments) under one heading of one page, in order."""
    return [b.code for b in blocks(page) if b.heading == heading and not b.fragment
            and b.language in EXAMPLE_LANGUAGES]


def run_block(tmp_path, code: str, env: dict | None = None, timeout: float = 180) -> str:
    """Runs ``code`` as a user would (``python example.py`` in an empty directory, the
    checkout importable) and returns its stdout, stripped; fails on a non-zero exit."""
    (tmp_path / "example.py").write_text(code)
    out = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=timeout,
                         env=dict(os.environ, PYTHONPATH=REPO, **(env or {})))
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()
