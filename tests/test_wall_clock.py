"""No test bounds a time that load can stretch: every assertion that compares a
wall-clock value (``<``, ``<=``, ``>``, ``>=``) says why load cannot break it, in a
``# wall-clock:`` comment on the assertion's own lines or in the comment lines directly
above it.

The tests run side by side (several at once on two cores, a busy loop holding one of
them), so such an assertion is one of: an order of events (this came before that, the
error came before the timeout would have fired); a lower bound that load only moves
further from (``elapsed >= timeout``: a sleep never ends early); or an upper bound at
least 3x the time the thing takes on an idle machine that still tells the failure apart
(a hang would be the 20 s call_timeout).  Speed targets live in ``make bench``.

What counts as a wall-clock value (followed through each module, scope by scope):

- a call of ``time.monotonic()``, ``time.perf_counter()``, ``time.time()`` (or their
  ``_ns`` forms), through ``import time [as t]`` or ``from time import monotonic [as m]``;
- what the library measured with its clock: ``.last_timings``, ``.stats(...)``,
  ``.load_seconds``, ``.restart_seconds``, a metric or span attribute named
  ``..._seconds``, and a span's ``.start_time`` and ``.end_time`` or an event's
  ``.timestamp``;
- a name assigned from an expression with one of those in it (``started =
  time.monotonic()``, ``elapsed = time.monotonic() - started``, ``t =
  runner.last_timings``), a loop's or comprehension's target over one, a container one
  is put into (``ticks.append(now)``, ``kill["at"] = now``), an attribute of ``self``
  (or of any name) assigned one, a parameter of the module's function called with one,
  and what a function or method of the module returns when it returns one (``gaps =
  await ticking(...)``, then ``max(gaps)``);
- and, by the same rules, code kept in a string (a script run in a subprocess).

``tests/test_seams.py`` holds the other scanner of the tests, in the same style.
"""

from __future__ import annotations

import ast
import dataclasses
import io
import pathlib
import textwrap
import tokenize

import pytest

TESTS = pathlib.Path(__file__).parent
SELF = pathlib.Path(__file__).name
CLOCKS = {"monotonic", "perf_counter", "time", "monotonic_ns", "perf_counter_ns", "time_ns"}
# What the library (or OpenTelemetry, for its spans) measured with a clock.
MEASURED = {"last_timings", "load_seconds", "restart_seconds", "start_time", "end_time",
            "timestamp"}
PUT = {"append", "appendleft", "extend", "insert", "add", "put", "put_nowait", "setdefault",
       "update"}
ORDER = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)
MARK = "# wall-clock:"
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


class Scopes(ast.NodeVisitor):
    """The scope each node is in, the names each scope binds, and where a name refers to:
    Python's rule (the innermost function that binds it, class bodies seen only from
    themselves, else the module), with ``global`` and ``nonlocal``; a comprehension is a
    scope of its own (but for the walrus)."""

    def __init__(self, tree: ast.Module) -> None:
        self.parent: dict[ast.AST, ast.AST | None] = {tree: None}
        self.scope_of: dict[ast.AST, ast.AST] = {}
        self.binds: dict[ast.AST, set[str]] = {tree: set()}
        self.moved: dict[ast.AST, dict[str, str]] = {}  # scope -> name -> global/nonlocal
        self.stack: list[ast.AST] = [tree]
        self.module = tree
        self.generic_visit(tree)

    def visit(self, node: ast.AST) -> None:
        self.scope_of[node] = self.stack[-1]
        super().visit(node)

    def enter(self, node: ast.AST, names: list[str]) -> None:
        self.parent[node] = self.stack[-1]
        self.binds[node] = set(names)
        self.stack.append(node)
        if isinstance(node, ast.Lambda):
            self.visit(node.body)
        elif isinstance(node, COMPREHENSIONS):
            for child in ast.iter_child_nodes(node):
                self.visit(child)
        else:
            for child in node.body:
                self.visit(child)
        self.stack.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.bind(node.name)
        for expr in [*node.decorator_list, *node.args.defaults,
                     *filter(None, node.args.kw_defaults)]:
            self.visit(expr)
        self.enter(node, [a.arg for a in parameters(node)])

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Lambda(self, node: ast.Lambda) -> None:
        for expr in [*node.args.defaults, *filter(None, node.args.kw_defaults)]:
            self.visit(expr)
        self.enter(node, [a.arg for a in parameters(node)])

    def visit_ListComp(self, node: ast.ListComp) -> None:
        self.enter(node, [])

    visit_SetComp = visit_DictComp = visit_GeneratorExp = visit_ListComp

    def visit_NamedExpr(self, node: ast.NamedExpr) -> None:
        scope = next(s for s in reversed(self.stack) if not isinstance(s, COMPREHENSIONS))
        self.scope_of[node.target] = scope
        self.binds[scope].add(node.target.id)
        self.visit(node.value)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.bind(node.name)
        for expr in [*node.decorator_list, *node.bases, *(k.value for k in node.keywords)]:
            self.visit(expr)
        self.enter(node, [])

    def visit_Global(self, node: ast.Global | ast.Nonlocal) -> None:
        kind = "global" if isinstance(node, ast.Global) else "nonlocal"
        self.moved.setdefault(self.stack[-1], {}).update(dict.fromkeys(node.names, kind))

    visit_Nonlocal = visit_Global

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, (ast.Store, ast.Del)):
            self.bind(node.id)

    def visit_alias(self, node: ast.alias) -> None:
        if node.name != "*":
            self.bind(node.asname or node.name.partition(".")[0])

    def visit_ExceptHandler(self, node: ast.ExceptHandler) -> None:
        if node.name:
            self.bind(node.name)
        self.generic_visit(node)

    def bind(self, name: str) -> None:
        self.binds[self.stack[-1]].add(name)

    def owner(self, scope: ast.AST, name: str) -> ast.AST:
        """The scope whose binding ``name`` (used in ``scope``) refers to."""
        moved = self.moved.get(scope, {}).get(name)
        if moved == "global":
            return self.module
        first = scope if moved is None else self.parent[scope]
        while first is not None:
            if name in self.binds[first] and (first is scope or not isinstance(
                    first, ast.ClassDef)) and name not in self.moved.get(first, {}):
                return first
            first = self.parent[first]
        return self.module


def parameters(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> list[ast.arg]:
    args = node.args
    return [*args.posonlyargs, *args.args, *filter(None, [args.vararg]), *args.kwonlyargs,
            *filter(None, [args.kwarg])]


class Clocks:
    """Which bindings of one module hold wall-clock values (a least fixed point)."""

    def __init__(self, tree: ast.Module) -> None:
        self.scopes = Scopes(tree)
        self.modules: set[str] = set()  # names bound to the time module
        self.functions: set[str] = set()  # names bound to time.monotonic & co
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                self.modules |= {a.asname or a.name for a in node.names if a.name == "time"}
            elif isinstance(node, ast.ImportFrom) and node.module == "time" and node.level == 0:
                self.functions |= {a.asname or a.name for a in node.names if a.name in CLOCKS}
        self.defs = {self.key(self.scopes.scope_of[n], n.name): n for n in ast.walk(tree)
                     if isinstance(n, FUNCTIONS[:2])}
        self.flows: list[tuple[list[tuple], ast.AST]] = []  # (bindings, the value they get)
        self.returned: list[tuple[list[tuple], ast.AST]] = []  # (a function, what it returns)
        self.passed: list[tuple[list[tuple], ast.AST]] = []  # (a parameter, an argument)
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                self.flows += [(self.targets(t), node.value) for t in node.targets]
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign, ast.NamedExpr)) and node.value:
                self.flows.append((self.targets(node.target), node.value))
            elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
                self.flows.append((self.targets(node.target), node.iter))
            elif isinstance(node, ast.withitem) and node.optional_vars is not None:
                self.flows.append((self.targets(node.optional_vars), node.context_expr))
            elif isinstance(node, ast.Call):
                self.calls(node)
            elif isinstance(node, (ast.Return, ast.Yield, ast.YieldFrom)) and node.value:
                self.returns(self.scopes.scope_of[node], node.value)
            elif isinstance(node, ast.Lambda):
                self.returns(node, node.body)
        # What a function returns is timed by what it does itself, not by what one
        # caller passes it (``of(samples, name)`` is no clock because one call passes a
        # timed name): first the flows and the returns, then the arguments on top.
        self.timed_keys: set[tuple] = set()
        self.settle(self.flows + self.returned)
        self.settle(self.flows + self.passed)

    def settle(self, flows: list[tuple[list[tuple], ast.AST]]) -> None:
        while True:
            before = len(self.timed_keys)
            for keys, value in flows:
                if self.timed(value):
                    self.timed_keys.update(keys)
            if len(self.timed_keys) == before:
                return

    def key(self, scope: ast.AST, name: str) -> tuple:
        return ("name", self.scopes.owner(scope, name), name)

    def targets(self, node: ast.AST) -> list[tuple]:
        """The bindings an assignment target sets; ``x[k] = v`` and ``x.y = v`` set x
        and x.y (an attribute by its name and the name it is taken from, in any scope)."""
        if isinstance(node, (ast.Tuple, ast.List)):
            return [k for e in node.elts for k in self.targets(e)]
        if isinstance(node, (ast.Starred, ast.Subscript)):
            return self.targets(node.value)
        if isinstance(node, ast.Name):
            return [self.key(self.scopes.scope_of[node], node.id)]
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            return [("attribute", node.value.id, node.attr)]
        if isinstance(node, ast.Attribute):
            return self.targets(node.value)
        return []

    def calls(self, node: ast.Call) -> None:
        """``ticks.append(now)`` puts a wall-clock value into ticks; ``check(elapsed)`` of
        the module's own ``def check(seconds)`` gives one to its parameter."""
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in PUT:
            self.flows.append((self.targets(func.value), ast.Tuple(
                [*node.args, *(k.value for k in node.keywords)], ast.Load())))
        if not isinstance(func, ast.Name):
            return
        called = self.defs.get(self.key(self.scopes.scope_of[node], func.id))
        if called is None:
            return
        params = [p.arg for p in [*called.args.posonlyargs, *called.args.args]]
        for name, value in [*zip(params, node.args, strict=False),
                            *((k.arg, k.value) for k in node.keywords if k.arg)]:
            self.passed.append(([self.key(called, name)], value))

    def returns(self, scope: ast.AST, value: ast.AST) -> None:
        """What a function returns, for its callers: ``f()`` and ``obj.f()``."""
        if isinstance(scope, FUNCTIONS[:2]):
            self.returned.append(([self.key(self.scopes.scope_of[scope], scope.name),
                                   ("method", scope.name)], value))
        elif isinstance(scope, ast.Lambda):
            self.returned.append(([("lambda", scope)], value))

    def is_clock(self, node: ast.AST) -> bool:
        if isinstance(node, ast.Constant):
            return isinstance(node.value, str) and node.value.endswith("_seconds")
        if isinstance(node, ast.Attribute):
            return node.attr in MEASURED
        if not isinstance(node, ast.Call):
            return False
        func = node.func
        if isinstance(func, ast.Name):
            return func.id in self.functions
        return isinstance(func, ast.Attribute) and (func.attr == "stats" or (
            func.attr in CLOCKS and isinstance(func.value, ast.Name)
            and func.value.id in self.modules))

    def is_timed(self, node: ast.AST) -> bool:
        """Whether this one node (not what is inside it) holds a wall-clock value."""
        if self.is_clock(node):
            return True
        if isinstance(node, ast.Name):
            return self.key(self.scopes.scope_of[node], node.id) in self.timed_keys
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            return ("attribute", node.value.id, node.attr) in self.timed_keys
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            return ("method", node.func.attr) in self.timed_keys
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Lambda):
            return ("lambda", node.func) in self.timed_keys
        return False

    def timed(self, expr: ast.AST) -> bool:
        """Whether an expression has a wall-clock value in it."""
        return any(self.is_timed(node) for node in ast.walk(expr))


def comments(source: str) -> dict[int, str]:
    """The comment on each line that has one."""
    found = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            found[token.start[0]] = token.string
    return found


@dataclasses.dataclass
class Scan:
    """One module's wall-clock assertions, ``(line, the assertion, explained)``; the
    lines of its ``# wall-clock:`` comments, and those that explain an assertion."""

    found: list[tuple[int, str, bool]] = dataclasses.field(default_factory=list)
    marks: set[int] = dataclasses.field(default_factory=set)
    used: set[int] = dataclasses.field(default_factory=set)


def explaining(node: ast.stmt, lines: list[str], notes: dict[int, str]) -> set[int]:
    """The ``# wall-clock:`` comments on a statement's lines or in the comment lines
    directly above it."""
    near = list(range(node.lineno, node.end_lineno + 1))
    line = node.lineno - 1
    while line >= 1 and lines[line - 1].strip().startswith("#"):
        near.append(line)
        line -= 1
    return {n for n in near if notes.get(n, "").startswith(MARK)}


def scan(source: str) -> Scan:
    tree = ast.parse(source)
    clocks, lines, notes = Clocks(tree), source.splitlines(), comments(source)
    result = Scan(marks={n for n, text in notes.items() if text.startswith(MARK)})
    for node in ast.walk(tree):
        if isinstance(node, ast.Assert) and any(
                isinstance(n, ast.Compare) and any(isinstance(op, ORDER) for op in n.ops)
                and clocks.timed(n) for n in ast.walk(node.test)):
            why = explaining(node, lines, notes)
            result.found.append((node.lineno, ast.unparse(node.test), bool(why)))
            result.used |= why
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "\n" in node.value:
            try:
                inner = scan(textwrap.dedent(node.value))
            except (SyntaxError, ValueError, tokenize.TokenError):
                continue  # not code
            shift = node.lineno - 1
            result.found += [(shift + n, f"{what} (in code kept in a string)", ok)
                             for n, what, ok in inner.found]
            result.marks |= {shift + n for n in inner.marks}
            result.used |= {shift + n for n in inner.used}
    result.found.sort()
    return result


def unexplained(source: str) -> list[tuple[int, str]]:
    return [(line, what) for line, what, ok in scan(source).found if not ok]


def modules() -> list[pathlib.Path]:
    """Every module in tests/ (tests and helpers) but this one, whose examples below are
    meant to be caught."""
    return [path for path in sorted(TESTS.glob("*.py")) if path.name != SELF]


def test_every_wall_clock_assertion_says_why_load_cannot_break_it():
    found = [f"tests/{path.name}:{line}: assert {what}"
             for path in modules() for line, what in unexplained(path.read_text())]
    assert not found, (
        "these assertions compare a wall-clock time, which a busy machine stretches: "
        "assert an order of events instead, or keep a lower bound that load cannot break, "
        "or an upper bound of 3x or more of what it takes on an idle machine, and say why "
        "in a '# wall-clock:' comment (on the assertion's lines or directly above it); "
        "speed targets belong in make bench:\n" + "\n".join(found))


def test_every_wall_clock_comment_explains_an_assertion_the_scanner_finds():
    """Each ``# wall-clock:`` comment sits on or directly above an assertion found above:
    so every bound that was given a margin and a reason would be flagged if the comment
    went (a bound the scanner could not see would leave its comment unused here)."""
    scans = {f"tests/{path.name}": scan(path.read_text()) for path in modules()}
    stray = [f"{name}:{line}" for name, s in scans.items() for line in sorted(s.marks - s.used)]
    assert not stray, ("'# wall-clock:' comments on or above no wall-clock assertion the "
                       "scanner finds (move each onto its assertion, or teach the scanner "
                       "what it missed):\n" + "\n".join(stray))
    explained = [f for s in scans.values() for f in s.found if f[2]]
    assert len(explained) > 0
    assert sum(len(s.marks) for s in scans.values()) >= len(explained)  # one each at least
    assert len(explained) == sum(len(s.found) for s in scans.values())  # and none without


def test_without_their_comments_every_explained_bound_would_be_flagged():
    explained = flagged = 0
    for path in modules():
        source = path.read_text()
        explained += sum(ok for _, _, ok in scan(source).found)
        flagged += len(unexplained(source.replace(MARK, "# (comment removed):")))
    assert explained > 0 and flagged == explained


FLAGGED = [
    "import time\nstarted = time.monotonic()\nassert time.monotonic() - started < 0.1",
    "import time\nstarted = time.monotonic()\nwork()\nelapsed = time.monotonic() - started\n"
    "assert elapsed < 1.4",
    "import time as t\nassert t.perf_counter() > 0",
    "from time import monotonic\nbegan = monotonic()\nassert monotonic() - began <= 5",
    "from time import monotonic as now\nx = now()\nassert x >= 0",
    "import time\ncaught = time.time()\nassert caught - stamp() < 1.0",
    "import time\ndeadline = time.monotonic() + 10\nwhile not ready():\n"
    "    assert time.monotonic() < deadline, 'condition not met in time'",
    "import time\nticks = []\nfor _ in range(3):\n    ticks.append(time.monotonic())\n"
    "gaps = [b - a for a, b in zip(ticks, ticks[1:])]\nassert max(gaps) < 0.1",
    "import time\nasync def ticking():\n    ticks = []\n    async def ticker():\n"
    "        ticks.append(time.monotonic())\n    return [b - a for a, b in zip(ticks, ticks[1:])]\n"
    "async def test():\n    gaps = await ticking()\n    assert len(gaps) >= 50",
    "import time\nkill = {}\ndef killer():\n    kill['at'] = time.monotonic()\n"
    "def test():\n    assert time.monotonic() - kill['at'] < 1",
    "import time\nclass App:\n    def kill(self):\n        return time.monotonic()\n"
    "def test(app):\n    died = app.kill()\n    assert wait() - died < 2.0",
    "import time\ndef within(since, bound):\n    assert since < bound\n"
    "def test():\n    within(time.monotonic(), 3)",
    "import time\nclass T:\n    def setup(self):\n        self.began = time.monotonic()\n"
    "    def check(self):\n        assert self.began > 0",
    "def test(runner):\n    t = runner.last_timings\n    assert t.compute[0] < 0.05",
    "def test(runner):\n    assert runner.stats().compute[1].p50 >= 0.01",
    "def test(record):\n    assert record.load_seconds >= 0.1",
    "def test(s):\n    assert of(s, 'reactor_dist_load_seconds', rank=0) >= 0",
    "def test(span, parent):\n    assert parent.start_time <= span.start_time",
    "import time\nSCRIPT = '''\nimport time\nstarted = time.monotonic()\n"
    "assert time.monotonic() - started < 1\n'''",
    "import time\nelapsed = time.monotonic()\n# wall-clock is not the mark\nassert elapsed < 1",
    "import time\nelapsed = time.monotonic()\n# wall-clock: too far up\n\nassert elapsed < 1",
]

LEFT_ALONE = [
    "import time\nstarted = time.monotonic()\nassert results == [1, 2]",
    "import time\ntime.sleep(0.5)\nassert len(calls) < 3",
    "import time\nelapsed = time.monotonic()\nassert elapsed == elapsed",  # no order
    "def f(started):\n    return started\nassert f(1) < 2",  # a name that is no clock
    "import time\ndef f():\n    started = time.monotonic()\n    return 0\n"
    "def g(started):\n    assert started < 1",  # another function's started
    "time = 1\nassert time < 2",
    "import datetime\nassert datetime.datetime.now().year > 2000",
    "import time\nelapsed = time.monotonic()\n"
    "assert elapsed < 3.0  # wall-clock: ideal 0.1 s, a hang would be the 20 s timeout",
    "import time\nelapsed = time.monotonic()\n# wall-clock: a lower bound: a sleep never\n"
    "# ends early, and load only lengthens it\nassert elapsed >= 0.5",
    "import time\nstarted = time.monotonic()\nassert (\n    time.monotonic() - started\n"
    "    < 3.0  # wall-clock: ideal 0.2 s\n)",
    "SCRIPT = '''\nimport time\nstarted = time.monotonic()\n"
    "assert time.monotonic() - started < 1  # wall-clock: ideal 0.1 s, in the script\n'''",
]


@pytest.mark.parametrize("source", FLAGGED)
def test_a_wall_clock_assertion_without_its_comment_is_named(source):
    assert unexplained(source), source


@pytest.mark.parametrize("source", LEFT_ALONE)
def test_other_assertions_and_explained_bounds_are_left_alone(source):
    assert unexplained(source) == []


def test_the_line_and_the_assertion_are_named():
    source = ("import time\n\nstarted = time.monotonic()\nassert started\n"
              "assert time.monotonic() - started < 0.1, 'slow'\n")
    assert unexplained(source) == [(5, "time.monotonic() - started < 0.1")]


def test_a_comment_explaining_nothing_is_found_as_unused():
    source = ("import time\nstarted = time.monotonic()\n"
              "# wall-clock: ideal 1 ms, a hang is 20 s\nassert started\n"
              "assert time.monotonic() - started < 0.5  # wall-clock: ideal 1 ms\n")
    result = scan(source)
    assert result.marks == {3, 5} and result.used == {5}
