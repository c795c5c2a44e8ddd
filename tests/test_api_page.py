"""The API page's summary (docs/api/index.md, "The runner at a glance") names every
constructor option and every public property and method of DistributedRunner, read
from the class itself, and no option it does not have (issue 46, item 5): a new
option or property fails here until the page has it."""

from __future__ import annotations

import inspect
import pathlib
import re

from reactor_dist import DistributedRunner

PAGE = pathlib.Path(__file__).parent.parent / "docs" / "api" / "index.md"


def summary() -> str:
    text = PAGE.read_text()
    start = text.index("## The runner at a glance")
    return text[start:text.index("\n## ", start + 1) if "\n## " in text[start + 1:] else None]


def options_on_page() -> set[str]:
    """``name=`` in the signature line and the Options paragraph."""
    text = summary()
    signature = text[text.index("**`DistributedRunner("):text.index(")`**")]
    options = text[text.index("Options:"):]
    options = options[:options.index("\n\n")]
    return set(re.findall(r"`(\w+)=", signature + options)) | \
        set(re.findall(r"\b(\w+)=", signature))


def rows_on_page() -> set[str]:
    """Each name in backticks in the table's first column."""
    return {name for line in summary().splitlines() if line.startswith("| `")
            for name in re.findall(r"`(?:async with |with )?(\w+)", line.split(" | ")[0])}


def test_every_constructor_option_is_on_the_api_page_and_no_other():
    options = set(inspect.signature(DistributedRunner).parameters) - {"worker_cls"}
    assert sorted(options - options_on_page()) == []
    assert sorted(options_on_page() - options) == []


def test_every_public_property_and_method_is_in_the_api_pages_table():
    public = {name for name, value in inspect.getmembers(DistributedRunner)
              if not name.startswith("_") and (isinstance(value, property) or callable(value))}
    assert sorted(public - rows_on_page()) == []
