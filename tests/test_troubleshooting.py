"""The Troubleshooting page lists every message a user can meet: each ``raise`` with a
message in reactor_dist, each warning and error it logs, and each public exception.

A message is found on the page by the beginning of its first literal run of words (the
parts between placeholders, which the page writes as N, X, …), so a new message, or a
changed beginning, fails here until the page has its row.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

import reactor_dist

REPO = pathlib.Path(__file__).parent.parent
PAGE = REPO / "docs" / "troubleshooting.md"
PACKAGE = pathlib.Path(reactor_dist.__file__).parent
LOG_CALLS = {"warning", "warn", "error"}
# Never shown to a user as themselves: CommandBlocked is caught inside the call path and
# becomes WorkerTimeout's "was sent to no rank"; the module __getattr__'s AttributeError
# is Python's own "module ... has no attribute ...".  TemplateFailed is caught where a
# rank is started: its text is the reason in "the rank template did not fork a rank".
NOT_SHOWN = {"CommandBlocked", "AttributeError", "TemplateFailed"}


def literal(node: ast.expr) -> str | None:
    """A message's text with each placeholder as NUL (f-string parts, %-style fields)."""
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "\0" for v in node.values)
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return re.sub(r"%[-\d.]*[sdfrg]", "\0", node.value)
    return None


def messages(source: str) -> list[tuple[int, str, str]]:
    """``(line, raised type or log call, beginning)`` of each message in one module."""
    found = []
    for node in ast.walk(ast.parse(source)):
        call, what = None, ""
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
            call = node.exc
            what = getattr(call.func, "id", getattr(call.func, "attr", ""))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in LOG_CALLS):
            call, what = node, node.func.attr
        if call is None or not call.args or what in NOT_SHOWN:
            continue
        text = literal(call.args[0])
        runs = [r.strip() for r in (text or "").split("\0") if len(r.strip()) >= 10]
        if runs:
            found.append((node.lineno, what, runs[0][:30]))
    return found


def plain(text: str) -> str:
    return re.sub(r"[`\\*]", "", text)


def missing(page: str, sources: dict[str, str]) -> list[str]:
    text = plain(page)
    return [f"{name}:{line}: {what}: {begins!r}"
            for name, source in sorted(sources.items())
            for line, what, begins in messages(source) if plain(begins) not in text]


def test_every_message_of_the_library_has_a_row():
    sources = {f"reactor_dist/{p.relative_to(PACKAGE)}": p.read_text()
               for p in PACKAGE.rglob("*.py")}
    absent = missing(PAGE.read_text(), sources)
    assert not absent, ("messages the Troubleshooting page (docs/troubleshooting.md) does not "
                        "list; give each a row:\n" + "\n".join(absent))


@pytest.mark.parametrize("name", [n for n in reactor_dist.__all__
                                  if isinstance(getattr(reactor_dist, n), type)
                                  and issubclass(getattr(reactor_dist, n), BaseException)])
def test_every_public_exception_is_on_the_page(name):
    assert f"`{name}`" in PAGE.read_text()


SOURCE = '''
import logging
log = logging.getLogger("x")
def f(n):
    raise ValueError(f"{n} frobs must be even, got {n}")
def g():
    log.warning("rank %d is late by %s s", 1, 2)
def h():
    raise CommandBlocked("a blocked command, never shown")
'''


def test_a_message_missing_from_the_page_is_named_with_its_line():
    page = "| `rank R is late by …` | log WARNING |"
    assert missing(page, {"m.py": SOURCE}) == ["m.py:5: ValueError: 'frobs must be even, got'"]
    assert missing(page + "\n| `N frobs must be even, got …` |", {"m.py": SOURCE}) == []
