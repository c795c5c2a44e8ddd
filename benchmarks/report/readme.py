"""The Performance page's tables: a full ``make bench`` into the default directory
rewrites the text between two marker comments in docs/performance.md, and nothing else."""

from __future__ import annotations

from pathlib import Path

START = "<!-- bench:start -->"
END = "<!-- bench:end -->"


def replace_between_markers(text: str, body: str) -> str:
    """``text`` with what lies between the markers replaced by ``body`` (the markers
    stay). Raises ValueError unless each marker occurs once, the start first."""
    if text.count(START) != 1 or text.count(END) != 1 or text.index(END) < text.index(START):
        raise ValueError(f"the page needs one {START} followed by one {END}")
    head = text[:text.index(START)]
    tail = text[text.index(END) + len(END):]
    return f"{head}{START}\n{body.strip()}\n{END}{tail}"


def update(readme: Path, body: str) -> None:
    readme.write_text(replace_between_markers(readme.read_text(), body))
