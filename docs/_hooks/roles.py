"""MkDocs hook: the docstrings' reST roles (``:meth:`x```, ``:class:`~a.b.C```) as plain
code on the API pages, where Markdown would otherwise show the role's name as text."""

from __future__ import annotations

import re
from typing import Any

ROLE = re.compile(r":(?:py:)?(?:meth|mod|class|func|attr|data|exc|obj):<code>(~?)([^<]*)</code>")


def shown(match: re.Match[str]) -> str:
    """``~a.b.C`` shows ``C``, as Sphinx does; anything else shows as written."""
    tilde, target = match.groups()
    return f"<code>{target.rsplit('.', 1)[-1] if tilde else target}</code>"


def on_page_content(html: str, **_: Any) -> str:
    return ROLE.sub(shown, html)
