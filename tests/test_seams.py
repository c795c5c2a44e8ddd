"""Tests go through public seams: no test module reaches a private name of reactor_dist
except tests/probe.py, the one place that may (so that a change inside the library
shows up in one file of the tests, not in twenty).

What counts as reaching a private name (``_x``: one leading underscore, not a dunder):

- importing it: ``from reactor_dist.x import _y``, ``import reactor_dist._x``;
- an attribute ``X._y`` (or ``getattr(X, "_y")``, ``monkeypatch.setattr(X, "_y", ...)``)
  whose object is not known to be someone else's.  Where each name in a file comes from
  is followed through imports and assignments: a name bound only to other libraries
  (``os._exit``, ``torch.cuda._sleep``, ``group = dist.distributed_c10d._get_default_group()``)
  or to the test's own object (``self._x`` in a test's class) may use ``_``; a name bound
  to reactor_dist, to what a test module gives (``Probe(runner)._supervisor``), or of
  unknown origin (a parameter, ``with small_runner() as runner``) may not.  ``self._y``
  in a class derived from reactor_dist's (a test worker) may only use what that class
  itself assigns;
- a string naming it: ``"reactor_dist.caller.runner._x"``; and code kept in a string (a script
  run in a subprocess) is checked by the same rules.
"""

from __future__ import annotations

import ast
import builtins
import pathlib
import re
import textwrap
import warnings

import pytest

TESTS = pathlib.Path(__file__).parent
PRIVATE_PATH = re.compile(r"\breactor_dist(?:\.\w+)*\._(?!_)\w*")
OWN = {"self", "cls", "super"}
LOCAL = {path.stem for path in TESTS.glob("*.py")}  # probe, conftest, sample_workers, ...
SELF = pathlib.Path(__file__).name
THIRD, OWNED, UNKNOWN, LIBRARY = range(4)  # ordered: the worst binding of a name wins


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def of_library(module: str | None) -> bool:
    return module is not None and (module == "reactor_dist" or module.startswith("reactor_dist."))


def root(node: ast.AST) -> tuple[ast.AST, str | None]:
    """What an expression starts from, and the first attribute taken from it:
    ``(a, "b")`` for ``a.b(c)[d].e``."""
    first = None
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript, ast.Starred, ast.Await)):
        if isinstance(node, ast.Attribute):
            first = node.attr
        node = node.func if isinstance(node, ast.Call) else node.value
    return node, first


def targets(node: ast.AST) -> list[str]:
    """The names an assignment target binds (``a, (b, *c)``; ``self.x`` as "self.x")."""
    if isinstance(node, ast.Name):
        return [node.id]
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id in OWN):
        return [f"self.{node.attr}"]
    if isinstance(node, (ast.Tuple, ast.List)):
        return [n for e in node.elts for n in targets(e)]
    if isinstance(node, ast.Starred):
        return targets(node.value)
    return []


class Origins:
    """Where each name of one module comes from (scope-blind: every binding of a name
    in the file counts, and the worst one wins)."""

    def __init__(self, tree: ast.Module) -> None:
        self.fixed: dict[str, int] = {}  # names whose origin an import or a parameter fixes
        self.bound: dict[str, list[ast.AST]] = {}  # names bound to expressions
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    name = alias.asname or alias.name.partition(".")[0]
                    self.fix(name, self.side_of(alias.name))
            elif isinstance(node, ast.ImportFrom):
                side = self.side_of(node.module) if node.level == 0 else THIRD
                for alias in node.names:
                    self.fix(alias.asname or alias.name, side)
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    self.bind(target, node.value)
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign, ast.NamedExpr)) and node.value:
                self.bind(node.target, node.value)
            elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
                self.bind(node.target, node.iter)
            elif isinstance(node, ast.withitem) and node.optional_vars is not None:
                self.bind(node.optional_vars, node.context_expr)
            elif isinstance(node, ast.arguments):
                for arg in [*node.posonlyargs, *node.args, *node.kwonlyargs,
                            *filter(None, [node.vararg, node.kwarg])]:
                    if arg.arg not in OWN:
                        self.fix(arg.arg, UNKNOWN)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.fix(node.name, UNKNOWN)  # what a test's helper returns: who knows
            elif isinstance(node, ast.ClassDef):
                self.fix(node.name, OWNED)  # the test's own class, unless derived from ours
                for base in node.bases:
                    self.bind(ast.Name(node.name), base)
            elif isinstance(node, ast.ExceptHandler) and node.name:
                self.fix(node.name, UNKNOWN)
        self.origin: dict[str, int] = {}
        while True:  # a least fixed point: origins only get worse, and there are four
            before = dict(self.origin)
            for name in {*self.fixed, *self.bound}:
                self.origin[name] = max([self.fixed.get(name, THIRD),
                                         *(self.of(e) for e in self.bound.get(name, []))])
            if self.origin == before:
                break

    @staticmethod
    def side_of(module: str | None) -> int:
        """What a module's names are: reactor_dist's, another library's, or of the tests'
        own modules (whose objects may hold the library's: ``Probe(runner)._supervisor``)."""
        if of_library(module):
            return LIBRARY
        return UNKNOWN if module is not None and module.partition(".")[0] in LOCAL else THIRD

    def fix(self, name: str, side: int) -> None:
        self.fixed[name] = max(self.fixed.get(name, THIRD), side)

    def bind(self, target: ast.AST, value: ast.AST) -> None:
        if (isinstance(target, (ast.Tuple, ast.List)) and isinstance(value, (ast.Tuple, ast.List))
                and len(target.elts) == len(value.elts)
                and not any(isinstance(e, ast.Starred) for e in [*target.elts, *value.elts])):
            for one, its in zip(target.elts, value.elts, strict=True):  # a from x, b from y
                self.bind(one, its)
            return
        for name in targets(target):
            self.bound.setdefault(name, []).append(value)

    def of(self, expr: ast.AST) -> int:
        """The origin of an expression's value, by the name it starts from."""
        start, first = root(expr)
        if not isinstance(start, ast.Name):
            return UNKNOWN
        if start.id in OWN:  # self.x.y: as what the file assigns to self.x, else its own
            return self.origin.get(f"self.{first}", OWNED) if first else OWNED
        if start.id in self.fixed or start.id in self.bound:
            return self.origin.get(start.id, THIRD)
        return THIRD if hasattr(builtins, start.id) else UNKNOWN


class Seams(ast.NodeVisitor):
    """The private names of reactor_dist one module reaches, as ``(line, what)``."""

    def __init__(self, tree: ast.Module) -> None:
        self.origins = Origins(tree)
        self.found: list[tuple[int, str]] = []
        self.classes: list[tuple[bool, set[str]]] = []  # (derived from reactor_dist's, own _x)
        self.visit(tree)

    def flag(self, node: ast.AST, what: str) -> None:
        self.found.append((node.lineno, what))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if of_library(alias.name) and any(map(private, alias.name.split("."))):
                self.flag(node, f"import {alias.name}")

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level == 0 and of_library(node.module):
            for name in [*node.module.split("."), *(a.name for a in node.names)]:
                if private(name):
                    self.flag(node, f"from {node.module} import "
                                    f"{', '.join(a.name for a in node.names)}")
                    break

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        derived = any(self.origins.of(base) == LIBRARY for base in node.bases)
        assigned = {t.attr for n in ast.walk(node) if isinstance(n, (ast.Assign, ast.AnnAssign))
                    for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                    and t.value.id == "self"}
        assigned |= {n.name for n in node.body
                     if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        assigned |= {name for n in node.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                     for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                     for name in targets(t)}
        self.classes.append((derived, assigned))
        self.generic_visit(node)
        self.classes.pop()

    def reaches(self, obj: ast.AST, attr: str) -> bool:
        """Whether ``obj.attr`` is a private name of reactor_dist (as far as can be told)."""
        if not private(attr):
            return False
        side = self.origins.of(obj)
        if side == OWNED and isinstance(obj, ast.Name) and obj.id in OWN and self.classes:
            derived, assigned = self.classes[-1]
            return derived and attr not in assigned
        return side in (UNKNOWN, LIBRARY)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if self.reaches(node.value, node.attr):
            self.flag(node, ast.unparse(node))
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
        if (name in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
                and self.reaches(node.args[0], node.args[1].value)):
            self.flag(node, ast.unparse(node))
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if not isinstance(node.value, str) or "reactor_dist" not in node.value:
            return
        paths = [match.group() for match in PRIVATE_PATH.finditer(node.value)]
        for path in paths:
            self.flag(node, repr(path))
        if paths:
            return  # named once is enough
        try:
            with warnings.catch_warnings():  # a string that is not code (a regex, say)
                warnings.simplefilter("ignore", (DeprecationWarning, SyntaxWarning))
                code = ast.parse(textwrap.dedent(node.value))
        except (SyntaxError, ValueError):
            return  # not code
        self.found += [(node.lineno + line - 1, f"{what} (in code kept in a string)")
                       for line, what in Seams(code).found]


def violations(source: str) -> list[tuple[int, str]]:
    return sorted(set(Seams(ast.parse(source)).found))


def test_no_test_reaches_a_private_name_of_the_library_but_probe():
    found = [f"tests/{path.name}:{line}: {what}"
             # probe.py may; this file's own examples below are meant to be caught
             for path in sorted(TESTS.glob("*.py")) if path.name not in ("probe.py", SELF)
             for line, what in violations(path.read_text())]
    assert not found, ("tests reach private names of reactor_dist; give tests/probe.py a "
                       "small documented member for what they need and use it:\n"
                       + "\n".join(found))


REACHES = [
    "from reactor_dist.caller.validation import _warned_auto_cpu",
    "from reactor_dist import _private",
    "import reactor_dist._inner",
    "from reactor_dist import wire\nwire._keyed(b'k', [])",
    "import reactor_dist.wire.framing as w\nw._keyed(b'k', [])",
    "import reactor_dist\nreactor_dist.caller.validation._warned_auto_cpu = True",
    "from reactor_dist import DistributedRunner\n"
    "with DistributedRunner(object) as runner:\n    runner._supervisor.bus",
    "def test(runner):\n    runner._supervisor",
    "with small_runner() as r:\n    r._queue",
    "from reactor_dist import DistributedRunner\nr = DistributedRunner(object)\nq = r.queue\nq._x",
    "def test(monkeypatch):\n"
    "    monkeypatch.setattr('reactor_dist.caller.validation._warned_auto_cpu', 0)",
    "def test(runner):\n    getattr(runner, '_supervisor')",
    "from probe import Probe\ndef test(runner):\n    Probe(runner)._supervisor.bus",
    "def test(monkeypatch, runner):\n    monkeypatch.setattr(runner, '_supervisor', None)",
    "from reactor_dist import DistributedWorker\n"
    "class W(DistributedWorker):\n    def generate(self, x, /):\n        return self._rank",
    "class W:\n    def load(self, runner):\n        self.runner, self.n = runner, 1\n"
    "    def generate(self, x, /):\n        self.runner._queue",
    "SCRIPT = '''\nfrom reactor_dist import DistributedRunner\n"
    "with DistributedRunner(object) as runner:\n    print(runner._supervisor)\n'''",
]

KEEPS_TO_ITSELF = [
    "import os\nos._exit(3)",
    "import sys\nsys._getframe(0)",
    "import torch\ntorch.cuda._sleep(10)",
    "import torch.distributed as dist\ngroup = dist.distributed_c10d._get_default_group()\n"
    "nccl = group._get_backend('cpu')\nnccl._is_initialized()",
    "import ray\nray._private.worker",
    "class Helper:\n    def __init__(self):\n        self._items = []\n"
    "    def add(self, x):\n        self._items.append(x)",
    "from reactor_dist import DistributedWorker\nclass W(DistributedWorker):\n"
    "    def load(self):\n        self._cache = {}\n    def generate(self, x, /):\n"
    "        return self._cache",
    "from reactor_dist import DistributedRunner\nDistributedRunner.__init__",
    "from reactor_dist.__main__ import main",
    "import sys\nCODE = 'from reactor_dist.__main__ import main; main()'",
    "from probe import Probe\ndef test(runner):\n    Probe(runner).shm_prefix",
    "class W:\n    def load(self):\n        import torch\n        self.torch, self.n = torch, 1\n"
    "    def generate(self, x, /):\n        self.torch.cuda._sleep(self.n)",
]


@pytest.mark.parametrize("source", REACHES)
def test_a_private_name_reached_is_named_with_its_line(source):
    assert violations(source), source


@pytest.mark.parametrize("source", KEEPS_TO_ITSELF)
def test_other_libraries_private_names_and_a_tests_own_are_left_alone(source):
    assert violations(source) == []


def test_the_line_and_the_expression_are_named():
    source = "import os\nfrom reactor_dist import wire\n\nwire._keyed(b'k', [])\nos._exit(0)\n"
    assert violations(source) == [(4, "wire._keyed")]
