"""The side rule: every module of reactor_dist is on the caller's side, the rank's side or
shared, and the caller's side and the rank's side never import each other.

The modules stay flat in reactor_dist/ (users type ``python -m reactor_dist.rank``,
``reactor_dist.numa``, ``reactor_dist.metrics``, ``reactor_dist.tracing``); this test is
what a package per side would otherwise enforce; the sides are the "side" column of the
design's module map (docs/design/modules.md), the one place they are written.

A rank runs in its own process, started by the runner: what the caller's side keeps (the
call queue, the supervisor, the bus's runner end) has no business there, and the rank's
own code (its serve loop, its torch group, its memory) none in the caller.  What both
need (the protocol, the framing, the segments and their ledger, the payload codec, the
exceptions) is shared, and imports neither side.  Every import counts: at module level,
inside functions, under ``TYPE_CHECKING``, ``importlib.import_module("reactor_dist.x")``.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

import reactor_dist

PACKAGE = pathlib.Path(reactor_dist.__file__).parent
CALLER, RANK, SHARED = "caller", "rank", "shared"

MODULE_MAP = pathlib.Path(__file__).parent.parent / "docs" / "design" / "modules.md"


def sides_in_the_module_map() -> dict[str, str]:
    """Each module's side, as the design's one module map states it (its "side" column):
    the table is the rule, so the page and the test cannot disagree."""
    sides = {}
    for line in MODULE_MAP.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[1] in (CALLER, RANK, SHARED):
            for name in cells[0].replace("`", "").split(","):
                sides[name.strip().removesuffix(".py")] = cells[1]
    return sides


SIDES = sides_in_the_module_map()
MAY_IMPORT = {CALLER: {CALLER, SHARED}, RANK: {RANK, SHARED}, SHARED: {SHARED}}


def modules() -> set[str]:
    return {path.stem for path in PACKAGE.glob("*.py")}


def imported(tree: ast.Module, package: set[str]) -> list[tuple[int, str]]:
    """The package's modules one module imports, as ``(line, module)``: ``from . import x``
    is module x where x is one, else the package's ``__init__``."""
    found = []

    def named(line: int, dotted: str, names: list[str]) -> None:
        parts = dotted.split(".") if dotted else []
        if parts:
            found.append((line, parts[0] if parts[0] in package else "__init__"))
        else:
            found.extend((line, n if n in package else "__init__") for n in names)

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            names = [a.name for a in node.names]
            if node.level == 1:
                named(node.lineno, node.module or "", names)
            elif node.level == 0 and node.module and node.module.split(".")[0] == "reactor_dist":
                named(node.lineno, node.module.partition(".")[2], names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                head, _, rest = alias.name.partition(".")
                if head == "reactor_dist":
                    named(node.lineno, rest, ["__init__"])
        elif (isinstance(node, ast.Call) and node.args
              and getattr(node.func, "attr", getattr(node.func, "id", None))
              in ("import_module", "__import__")
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and node.args[0].value.split(".")[0] == "reactor_dist"):
            named(node.lineno, node.args[0].value.partition(".")[2], ["__init__"])
    return found


def crossings(sides: dict[str, str], sources: dict[str, str]) -> list[str]:
    """Every import from one side into a side it may not import, as ``module.py:line``."""
    package = set(sources)
    wrong = []
    for name, source in sorted(sources.items()):
        side = sides[name]
        for line, target in imported(ast.parse(source), package):
            if target != name and sides[target] not in MAY_IMPORT[side]:
                wrong.append(f"reactor_dist/{name}.py:{line}: {side}-side {name} imports "
                             f"{sides[target]}-side {target}")
    return wrong


def test_every_module_is_placed_on_a_side():
    missing, gone = sorted(modules() - set(SIDES)), sorted(set(SIDES) - modules())
    assert not missing, (f"modules on no side: {missing}; give each a row in the module map "
                         f"({MODULE_MAP.name}, side: caller, rank or shared)")
    assert not gone, f"the module map names modules that no longer exist: {gone}"


def test_the_callers_side_and_the_ranks_side_never_import_each_other():
    sources = {name: (PACKAGE / f"{name}.py").read_text() for name in modules()}
    wrong = crossings(SIDES, sources)
    assert not wrong, ("the caller's side and the rank's side import each other (move what "
                       "both need into a shared module):\n" + "\n".join(wrong))


SIDES_OF_AN_EXAMPLE = {"__init__": CALLER, "runner": CALLER, "rank": RANK, "wire": SHARED}


@pytest.mark.parametrize("module, source, found", [
    ("rank", "from .runner import DistributedRunner",
     "reactor_dist/rank.py:1: rank-side rank imports caller-side runner"),
    ("rank", "def f():\n    from . import runner",
     "reactor_dist/rank.py:2: rank-side rank imports caller-side runner"),
    ("rank", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
             "    from reactor_dist.runner import DistributedRunner",
     "reactor_dist/rank.py:3: rank-side rank imports caller-side runner"),
    ("rank", "from reactor_dist import DistributedRunner",
     "reactor_dist/rank.py:1: rank-side rank imports caller-side __init__"),
    ("runner", "import reactor_dist.rank",
     "reactor_dist/runner.py:1: caller-side runner imports rank-side rank"),
    ("runner", "import importlib\nimportlib.import_module('reactor_dist.rank')",
     "reactor_dist/runner.py:2: caller-side runner imports rank-side rank"),
    ("wire", "from .rank import main",
     "reactor_dist/wire.py:1: shared-side wire imports rank-side rank"),
    ("wire", "from . import runner",
     "reactor_dist/wire.py:1: shared-side wire imports caller-side runner"),
])
def test_a_crossing_is_named_with_its_line(module, source, found):
    sources = dict.fromkeys(SIDES_OF_AN_EXAMPLE, "")
    sources[module] = source
    assert crossings(SIDES_OF_AN_EXAMPLE, sources) == [found]


@pytest.mark.parametrize("module, source", [
    ("runner", "from . import wire"),
    ("rank", "from .wire import Channel\nimport zmq\nfrom os import path"),
    ("runner", "from reactor_dist.wire import Channel\nfrom . import runner"),
    ("wire", "import msgpack\nfrom . import wire"),
])
def test_imports_within_a_side_or_of_shared_modules_pass(module, source):
    sources = dict.fromkeys(SIDES_OF_AN_EXAMPLE, "")
    sources[module] = source
    assert crossings(SIDES_OF_AN_EXAMPLE, sources) == []


def circles(sources: dict[str, str]) -> list[list[str]]:
    """Every import circle among the package's modules (strongly connected groups of two
    or more), counting every import: at module level, inside a function, or only for the
    type checker (``if TYPE_CHECKING:``); the package's lazy ``__init__`` is left out (it
    imports DistributedRunner on first use only, PEP 562)."""
    package = set(sources)
    edges = {name: {t for _, t in imported(ast.parse(source), package)
                    if t != name and t != "__init__"}
             for name, source in sources.items() if name != "__init__"}
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(name: str) -> None:  # Tarjan's strongly connected components
        order[name] = low[name] = len(order)
        stack.append(name)
        for target in sorted(edges.get(name, ())):
            if target not in order:
                visit(target)
                low[name] = min(low[name], low[target])
            elif target in stack:
                low[name] = min(low[name], order[target])
        if low[name] == order[name]:
            group = []
            while True:
                top = stack.pop()
                group.append(top)
                if top == name:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for name in sorted(edges):
        if name not in order:
            visit(name)
    return found


def test_no_module_imports_a_module_that_imports_it_back():
    sources = {path.stem: path.read_text() for path in PACKAGE.glob("*.py")}
    assert circles(sources) == [], ("import circles (a lower module that must name an upper "
                                    "one uses a typing.Protocol of what it calls)")


def test_a_circle_is_found_through_type_checking_and_function_imports():
    sources = {
        "upper": "from .lower import helper\n",
        "lower": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                 "    from .upper import Thing\n",
        "a": "def f():\n    from . import b\n",
        "b": "from .a import f\n",
        "alone": "from . import lower\n",
    }
    assert sorted(circles(sources)) == [["a", "b"], ["lower", "upper"]]
