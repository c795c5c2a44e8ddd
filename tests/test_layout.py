"""The side rule and the folders: every module of reactor_dist is on the caller's side,
the rank's side or shared, the caller's side and the rank's side never import each
other, and each folder holds one side's modules (caller/ and placement/ the caller's,
rank/ the rank's, shm/ and wire/ shared ones).

The sides are the "side" column of the design's module map (docs/design/modules.md),
the one place they are written; a module is named there by its path under reactor_dist/
(``caller/calls.py``).  A rank runs in its own process, started by the runner: what the
caller's side keeps (the call queue, the supervisor, the bus's runner end) has no
business there, and the rank's own code (its serve loop, its torch group, its memory)
none in the caller.  What both need (the protocol, the framing, the segments and their
ledger, the payload codec, the exceptions) is shared, and imports neither side.  Every
import counts: at module level, inside functions, under ``TYPE_CHECKING``,
``importlib.import_module("reactor_dist.x")``.

Here a module's name is its dotted path under the package (``caller.calls``; a folder's
``__init__.py`` is the folder's name, the package's own ``__init__``).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

import reactor_dist

PACKAGE = pathlib.Path(reactor_dist.__file__).parent
CALLER, RANK, SHARED = "caller", "rank", "shared"
FOLDER_SIDES = {"caller": CALLER, "placement": CALLER, "rank": RANK, "shm": SHARED,
                "wire": SHARED}

MODULE_MAP = pathlib.Path(__file__).parent.parent / "docs" / "design" / "modules.md"


def name_of(path: str) -> str:
    """``caller/calls.py`` -> ``caller.calls``; ``rank/__init__.py`` -> ``rank``;
    ``__init__.py`` -> ``__init__``."""
    parts = path.removesuffix(".py").split("/")
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def sides_in_the_module_map() -> dict[str, str]:
    """Each module's side, as the design's one module map states it (its "side" column):
    the table is the rule, so the page and the test cannot disagree."""
    sides = {}
    for line in MODULE_MAP.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[1] in (CALLER, RANK, SHARED):
            for path in cells[0].replace("`", "").split(","):
                sides[name_of(path.strip())] = cells[1]
    return sides


SIDES = sides_in_the_module_map()
MAY_IMPORT = {CALLER: {CALLER, SHARED}, RANK: {RANK, SHARED}, SHARED: {SHARED}}


def module_paths() -> dict[str, pathlib.Path]:
    return {name_of(str(path.relative_to(PACKAGE))): path
            for path in sorted(PACKAGE.rglob("*.py"))}


def modules() -> set[str]:
    return set(module_paths())


def resolve(dotted: list[str], names: list[str], package: set[str]) -> list[str]:
    """The package's modules that ``from <dotted> import <names>`` reaches: a name that
    is a module is that module, else the longest prefix of ``dotted`` that is one (the
    package's own ``__init__`` for none)."""
    found = []
    prefix = ".".join(dotted)
    rest = [n for n in names if f"{prefix}.{n}".lstrip(".") in package]
    found.extend(f"{prefix}.{n}".lstrip(".") for n in rest)
    if len(rest) < len(names) or not names:
        for cut in range(len(dotted), 0, -1):
            if ".".join(dotted[:cut]) in package:
                found.append(".".join(dotted[:cut]))
                break
        else:
            found.append("__init__")
    return found


def imported(name: str, tree: ast.Module, package: set[str]) -> list[tuple[int, str]]:
    """The package's modules that module ``name`` imports, as ``(line, module)``."""
    here = name.split(".")
    is_folder = (PACKAGE / pathlib.Path(*here) / "__init__.py").exists() if name in package \
        and name != "__init__" else False
    folder = here if is_folder else here[:-1]  # the package a relative import starts from
    if name == "__init__":
        folder = []
    found: list[tuple[int, str]] = []

    def add(line: int, dotted: list[str], names: list[str]) -> None:
        found.extend((line, target) for target in resolve(dotted, names, package))

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            names = [a.name for a in node.names]
            if node.level >= 1:
                base = folder[:len(folder) - (node.level - 1)] if node.level > 1 else folder
                add(node.lineno, base + (node.module.split(".") if node.module else []), names)
            elif node.module and node.module.split(".")[0] == "reactor_dist":
                add(node.lineno, node.module.split(".")[1:], names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "reactor_dist":
                    add(node.lineno, parts[1:], [])
        elif (isinstance(node, ast.Call) and node.args
              and getattr(node.func, "attr", getattr(node.func, "id", None))
              in ("import_module", "__import__")
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and node.args[0].value.split(".")[0] == "reactor_dist"):
            add(node.lineno, node.args[0].value.split(".")[1:], [])
    return found


def crossings(sides: dict[str, str], sources: dict[str, str]) -> list[str]:
    """Every import from one side into a side it may not import, as ``module:line``."""
    package = set(sources)
    wrong = []
    for name, source in sorted(sources.items()):
        side = sides[name]
        for line, target in imported(name, ast.parse(source), package):
            if target != name and sides[target] not in MAY_IMPORT[side]:
                wrong.append(f"{name}:{line}: {side}-side {name} imports "
                             f"{sides[target]}-side {target}")
    return wrong


def test_every_module_is_placed_on_a_side():
    missing, gone = sorted(modules() - set(SIDES)), sorted(set(SIDES) - modules())
    assert not missing, (f"modules on no side: {missing}; give each a row in the module map "
                         f"({MODULE_MAP.name}, side: caller, rank or shared)")
    assert not gone, f"the module map names modules that no longer exist: {gone}"


def test_each_folder_holds_one_sides_modules_and_short_names_are_unique():
    wrong = [f"{name} is {SIDES[name]}-side in {name.split('.')[0]}/, a folder of "
             f"{FOLDER_SIDES[name.split('.')[0]]}-side modules"
             for name in sorted(modules()) if name.split(".")[0] in FOLDER_SIDES
             and SIDES.get(name) != FOLDER_SIDES[name.split(".")[0]]]
    assert wrong == []
    folders = {path.parent.name for path in PACKAGE.glob("*/__init__.py")}
    assert folders == set(FOLDER_SIDES)
    shorts: dict[str, list[str]] = {}
    for name in modules():
        short = name.rpartition(".")[2]
        if short not in ("__main__", "__init__"):
            shorts.setdefault(short, []).append(name)
    assert {s: n for s, n in shorts.items() if len(n) > 1} == {}


def test_the_callers_side_and_the_ranks_side_never_import_each_other():
    sources = {name: path.read_text() for name, path in module_paths().items()}
    wrong = crossings(SIDES, sources)
    assert not wrong, ("the caller's side and the rank's side import each other (move what "
                       "both need into a shared module):\n" + "\n".join(wrong))


SIDES_OF_AN_EXAMPLE = {"__init__": CALLER, "caller": CALLER, "caller.runner": CALLER,
                       "rank": RANK, "rank.server": RANK, "wire": SHARED,
                       "wire.framing": SHARED, "errors": SHARED}


@pytest.mark.parametrize("module, source, found", [
    ("rank.server", "from ..caller.runner import DistributedRunner",
     "rank.server:1: rank-side rank.server imports caller-side caller.runner"),
    ("rank.server", "def f():\n    from ..caller import runner",
     "rank.server:2: rank-side rank.server imports caller-side caller.runner"),
    ("rank.server", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                    "    from reactor_dist.caller.runner import DistributedRunner",
     "rank.server:3: rank-side rank.server imports caller-side caller.runner"),
    ("rank.server", "from reactor_dist import DistributedRunner",
     "rank.server:1: rank-side rank.server imports caller-side __init__"),
    ("rank.server", "from .. import DistributedRunner",
     "rank.server:1: rank-side rank.server imports caller-side __init__"),
    ("caller.runner", "import reactor_dist.rank.server",
     "caller.runner:1: caller-side caller.runner imports rank-side rank.server"),
    ("caller.runner", "import importlib\nimportlib.import_module('reactor_dist.rank')",
     "caller.runner:2: caller-side caller.runner imports rank-side rank"),
    ("wire.framing", "from ..rank.server import main",
     "wire.framing:1: shared-side wire.framing imports rank-side rank.server"),
    ("wire.framing", "from ..caller import runner",
     "wire.framing:1: shared-side wire.framing imports caller-side caller.runner"),
    ("wire", "from ..caller import runner",
     "wire:1: shared-side wire imports caller-side caller.runner"),
])
def test_a_crossing_is_named_with_its_line(module, source, found):
    sources = dict.fromkeys(SIDES_OF_AN_EXAMPLE, "")
    sources[module] = source
    assert crossings(SIDES_OF_AN_EXAMPLE, sources) == [found]


@pytest.mark.parametrize("module, source", [
    ("caller.runner", "from ..wire import framing"),
    ("rank.server", "from ..wire.framing import Channel\nimport zmq\nfrom os import path"),
    ("caller.runner", "from reactor_dist.wire.framing import Channel\nfrom . import runner"),
    ("wire.framing", "import msgpack\nfrom .. import errors\nfrom . import framing"),
])
def test_imports_within_a_side_or_of_shared_modules_pass(module, source):
    sources = dict.fromkeys(SIDES_OF_AN_EXAMPLE, "")
    sources[module] = source
    assert crossings(SIDES_OF_AN_EXAMPLE, sources) == []


def circles(sources: dict[str, str]) -> list[list[str]]:
    """Every import circle among the package's modules (strongly connected groups of two
    or more), counting every import: at module level, inside a function, or only for the
    type checker (``if TYPE_CHECKING:``); the package's lazy ``__init__`` is left out (it
    imports DistributedRunner on first use only, PEP 562), and so are the folders'
    ``__init__`` (a docstring each)."""
    package = set(sources)
    edges = {name: {t for _, t in imported(name, ast.parse(source), package)
                    if t != name and t != "__init__" and t not in FOLDER_SIDES}
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
    sources = {name: path.read_text() for name, path in module_paths().items()}
    assert circles(sources) == [], ("import circles (a lower module that must name an upper "
                                    "one uses a typing.Protocol of what it calls)")


def test_the_folders_init_modules_hold_only_a_docstring():
    """A folder is a place, not an API: importing reactor_dist.caller runs nothing."""
    for folder in FOLDER_SIDES:
        tree = ast.parse((PACKAGE / folder / "__init__.py").read_text())
        assert len(tree.body) == 1 and isinstance(tree.body[0], ast.Expr), folder


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
