"""Every name the pages write in backticks is a name the code has (issue 30: the docs
are the code). ``mkdocs build --strict`` checks links and the API reference, not the
names in the prose; this test does.

It reads README.md and docs/**/*.md, skips the fenced code blocks (examples, run by
tests/test_docs_examples.py) and takes every inline code span. A span is a **name
reference** when it is a dotted name, optionally followed by a call's parentheses and
whatever follows them (``generate(input, *, timeout=call_timeout)``, ``stats().restarts``:
only the dotted part before the first ``(`` is checked), or a file name ending in
``.py``. A leading ``await`` is dropped. Anything else is not a name: a span with a
space, ``=``, an operator, quotes or brackets outside the parentheses (a command such as
``make test``, an option value such as ``placement="ray"``, a message, a path that is
not a .py file), or one that starts with a dot (``.cpu()``, a method of a tensor).

How a name reference resolves, first rule that applies:

1. ``x.py`` (``workers/video.py``): with a folder, that path exists from the repository
   root or from reactor_dist/ (``caller/calls.py``, as the module map writes it);
   bare, a file of that name exists in reactor_dist/, tests/, benchmarks/, workers/ or
   examples/ (at any depth). A standard-library module's file
   (``argparse.py``) is Python's.
2. A bare ``CapWords`` name, called or not (``DistributedRunner(...)``): a name
   defined at the top level of a module of the package or of workers/ (the ready models
   shipped with it: ``RolloutExhausted``), or one the package resolves (a deprecated
   alias); a Python builtin (``TypeError``) is Python's. A foreign class is written
   with its module (``threading.Condition``), so that rule 4 knows it. A bare
   ``ALL_CAPS`` name (an environment variable, a signal, a header field or constant in
   its page's context) and a bare ``lowercase`` one without parentheses (a parameter, a
   field, a state, a word) are not checked: alone they name no object.
3. A bare ``name()``: a method of DistributedRunner or DistributedWorker (the API: the
   runner's calls and the worker's methods), else a function at the top level of a
   module of the package, else a method of any class of the package; else a Python
   builtin (``next()``) is Python's.
4. A dotted name, by its first part, in this order: ``reactor_dist`` is the package
   (submodules are imported as the chain needs them) and ``workers`` the ready models'
   package; ``runner`` is a DistributedRunner and ``self`` a DistributedWorker (the
   pages' examples write a worker's methods so); a module of the package
   (``calls.CallPath.send``; it wins over a standard-library module of the same name); a
   foreign root (FOREIGN_ROOTS, or a top-level module of the standard library:
   ``time.monotonic()``) is not checked; a ``CapWords`` first part resolves as in rule
   2 (``Supervisor.close``); any other first part is unresolved (write ``Call.stream``,
   not ``call.stream``).
   Then each further part is an attribute of what the chain has reached: a module's
   attribute or submodule, a class's attribute, the class a property is annotated to
   return (``runner.last_timings.busy``), or, last in the chain, an attribute that the
   class (or a base of it in the package) assigns as ``self.x`` or declares (a
   dataclass or NamedTuple field, a class-level annotation).
5. OpenTelemetry's span, event and attribute names (``reactor_dist.generate``,
   ``reactor_dist.world_size``) are not Python names: a ``reactor_dist.x`` that rule 4
   does not resolve is accepted when reactor_dist/tracing.py emits it, as the literal
   ``"reactor_dist.x"`` or as ``f"reactor_dist.{name}"`` with ``x`` a method of
   DistributedRunner.

ALLOWED lists the few true exceptions, each with its reason.
"""

from __future__ import annotations

import ast
import builtins
import functools
import importlib
import inspect
import os
import pathlib
import pkgutil
import re
import sys
import types
import typing
import warnings
from typing import Any, NamedTuple

import pytest
from docs_pages import REPO, pages

import reactor_dist
import workers
from reactor_dist import DistributedRunner, DistributedWorker

# First parts of a dotted name that are other projects' (rule 4); the standard library's
# top-level modules are added from sys.stdlib_module_names.
FOREIGN_ROOTS = frozenset({
    "torch", "dist",  # dist: torch.distributed, as its documentation imports it
    "np", "numpy", "ray", "zmq", "msgpack", "psutil", "prometheus_client", "opentelemetry",
    "pytest", "hypothesis",
    "transformers", "diffusers",  # the third-party models' frameworks (workers/, the recipes)
    "loop",  # an asyncio event loop (loop.add_reader)
})
# The folders where a bare file name (rule 1) may live.
FILE_FOLDERS = ("reactor_dist", "tests", "benchmarks", "workers", "examples")
# A span -> why it is right although the rules do not resolve it. Keep this short.
ALLOWED: dict[str, str] = {
    "quickstart.py": "the file the Quickstart tells the reader to save its example in",
    "error.type": "OpenTelemetry's attribute for a failed span's error class (set in "
                  "tracing.py), not a Python name",
}

SPAN = re.compile(r"(?<!`)(`+)(?!`)((?:(?!\n[ \t]*\n).)+?)(?<!`)\1(?!`)", re.S)
DOTTED = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"
NAME = re.compile(rf"^(?P<name>{DOTTED})(?P<call>\(.*\).*)?$")
FILE = re.compile(r"^(?:[\w.-]+/)*[\w.-]*\w\.py$")


class Span(NamedTuple):
    page: str
    line: int  # where the span starts, 1-based
    code: str  # its text, whitespace runs as one space


def spans(text: str, page: str = "<text>") -> list[Span]:
    """The inline code spans of a Markdown text, outside its fenced blocks."""
    kept, fenced = [], False
    for line in text.split("\n"):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            kept.append("")
        else:
            kept.append("" if fenced else line)
    prose = "\n".join(kept)
    return [Span(page, prose.count("\n", 0, m.start()) + 1, " ".join(m.group(2).split()))
            for m in SPAN.finditer(prose)]


# --- the package, as the rules see it


def submodules(package: Any) -> dict[str, Any]:
    """Every module of a package and of its subpackages by its short name (``calls``,
    ``caller``), imported (the short names are unique: tests/test_layout.py)."""
    found = {}
    for info in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
        short = info.name.rpartition(".")[2]
        if short != "__main__":  # importing it runs the command line (or a rank)
            found[short] = importlib.import_module(info.name)
    return found


@functools.cache
def modules() -> dict[str, Any]:
    return submodules(reactor_dist)


def top_level_names(module: Any) -> set[str]:
    """The names a module's source defines at its top level (not the ones it imports);
    a compiled module (framing's C half) by what it holds."""
    if not module.__file__.endswith(".py"):
        return {name for name in vars(module) if not name.startswith("__")}
    tree = ast.parse(inspect.getsource(module))
    names: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
            elif isinstance(node, (ast.If, ast.Try)):
                visit(node.body + getattr(node, "orelse", []) + getattr(node, "finalbody", [])
                      + [s for h in getattr(node, "handlers", []) for s in h.body])
    visit(tree.body)
    return names


@functools.cache
def defined() -> dict[str, list[Any]]:
    """Each top-level name of the package's modules -> the objects of that name."""
    found: dict[str, list[Any]] = {}
    for module in [*modules().values(), *submodules(workers).values()]:
        for name in top_level_names(module):
            if hasattr(module, name):
                found.setdefault(name, []).append(getattr(module, name))
    return found


def package_classes() -> list[type]:
    return [obj for objs in defined().values() for obj in objs if inspect.isclass(obj)
            and obj.__module__.startswith(("reactor_dist", "workers"))]


def instance_attributes(cls: type) -> set[str]:
    """What a class of the package (and its bases in the package) assigns as ``self.x``
    or declares as a field."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if not klass.__module__.startswith(("reactor_dist", "workers")):
            continue
        names.update(getattr(klass, "__dataclass_fields__", {}))
        names.update(getattr(klass, "__annotations__", {}))
        names.update(getattr(klass, "_fields", ()))
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):  # made at run time: no source of its own
            continue
        for node in ast.walk(ast.parse(source.strip())):
            if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                    and isinstance(node.value, ast.Name) and node.value.id == "self"):
                names.add(node.attr)
    return names


def follow(obj: Any, parts: list[str]) -> str | None:
    """Walks ``parts`` from ``obj``; None when every part resolves, else what did not."""
    for i, part in enumerate(parts):
        if inspect.ismodule(obj) and not hasattr(obj, part):
            try:
                importlib.import_module(f"{obj.__name__}.{part}")
            except ModuleNotFoundError:
                return f"{obj.__name__} has no {part!r}"
        if isinstance(obj, property):
            obj = returned_class(obj)
            if obj is None:
                return f"the property before {part!r} is not annotated to return one class"
        if hasattr(obj, part):
            obj = getattr(obj, part)
        elif inspect.isclass(obj) and part in instance_attributes(obj):
            if i < len(parts) - 1:
                return f"{obj.__name__}.{part} is an instance attribute: the chain stops there"
            return None
        else:
            return f"{getattr(obj, '__name__', obj)} has no {part!r}"
    return None


def returned_class(prop: property) -> type | None:
    """The class a property's getter is annotated to return (``X | None`` counts as X)."""
    try:
        hint = typing.get_type_hints(prop.fget).get("return")
    except Exception:  # a name only imported for type checking
        return None
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        classes = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = classes[0] if len(classes) == 1 else None
    return hint if inspect.isclass(hint) else None


def the_package_has(name: str) -> bool:
    with warnings.catch_warnings():  # a deprecated alias warns as it is read
        warnings.simplefilter("ignore")
        return hasattr(reactor_dist, name)


def methods(cls: type) -> set[str]:
    return {name for name, _ in inspect.getmembers(cls, callable)}


@functools.cache
def trace_names() -> set[str]:
    with open(os.path.join(REPO, "reactor_dist", "tracing.py")) as f:
        source = f.read()
    names = {f"reactor_dist.{x}" for x in re.findall(r'"reactor_dist\.(\w+)"', source)}
    if 'f"reactor_dist.{name}"' in source:
        names |= {f"reactor_dist.{m}" for m in methods(DistributedRunner) if m[0] != "_"}
    return names


@functools.cache
def files() -> set[str]:
    found = set()
    for folder in FILE_FOLDERS:
        for _, _, names in os.walk(os.path.join(REPO, folder)):
            found.update(n for n in names if n.endswith(".py"))
    return found


FOREIGN = FOREIGN_ROOTS | sys.stdlib_module_names
INSTANCES = {"runner": DistributedRunner, "self": DistributedWorker}
NOT_DEFINED = ("no module of the package defines {!r} (a foreign name is written with its "
               "module: `threading.Condition`)")


def unresolved(code: str) -> str | None:
    """Why the span names nothing in the code; None when it resolves or is no name."""
    code = code.removeprefix("await ")
    if code in ALLOWED:
        return None
    if FILE.match(code):  # rule 1
        if "/" in code:
            return None if os.path.isfile(os.path.join(REPO, code)) or \
                os.path.isfile(os.path.join(REPO, "reactor_dist", code)) else "no such file"
        if code[:-3] in sys.stdlib_module_names or code in files():
            return None
        return f"no such file in {', '.join(f + '/' for f in FILE_FOLDERS)}"
    match = NAME.match(code)
    if not match:
        return None  # not a name reference
    parts = match.group("name").split(".")
    root, rest = parts[0], parts[1:]
    capwords = root[0].isupper() and not root.isupper()
    if not rest and (capwords or match.group("call") is None):  # rule 2
        if (not capwords or hasattr(builtins, root) or root in defined()
                or the_package_has(root)):
            return None
        return NOT_DEFINED.format(root)
    if not rest:  # rule 3
        if root in methods(DistributedRunner) | methods(DistributedWorker):
            return None
        if any(inspect.isfunction(obj) for obj in defined().get(root, [])):
            return None
        if any(root in methods(cls) for cls in package_classes()) or hasattr(builtins, root):
            return None
        return f"no function or method {root}() in the package"
    if root == "reactor_dist":  # rules 4 and 5
        why = follow(reactor_dist, rest)
        return None if why is None or ".".join(parts) in trace_names() else why
    if root == "workers":
        return follow(workers, rest)
    if root in INSTANCES:
        return follow(INSTANCES[root], rest)
    if root in modules():
        return follow(modules()[root], rest)
    if root in FOREIGN:
        return None
    if capwords:
        candidates = defined().get(root, [])
        if not candidates:
            return NOT_DEFINED.format(root)
        whys = [follow(obj, rest) for obj in candidates]
        return None if None in whys else whys[0]
    return (f"{root!r} is neither the package, a module of it, an instance the rules know "
            f"(runner, self) nor a foreign root: name the class")


def problems(found: list[Span]) -> list[str]:
    out = []
    for span in found:
        why = unresolved(span.code)
        if why is not None:
            out.append(f"{span.page}:{span.line}: `{span.code}`: {why}")
    return out


def all_spans() -> list[Span]:
    found = []
    for page in pages():
        with open(os.path.join(REPO, page)) as f:
            found += spans(f.read(), page)
    return found


def test_every_name_in_backticks_on_every_page_is_in_the_code():
    assert problems(all_spans()) == []


def test_allowed_holds_only_spans_the_pages_write_and_the_rules_reject():
    written = {s.code for s in all_spans()}
    saved = dict(ALLOWED)
    try:
        ALLOWED.clear()
        left = [code for code in saved if code not in written or unresolved(code) is None]
    finally:
        ALLOWED.update(saved)
    assert left == []


FIXTURE = """\
# A page

The runner's `runner.generate(x)` sends a call (`calls.CallPath.send`), and
`Supervisor.collect` gathers the answers; `generate()`, `DistributedWorker` and
`workers/video.py` exist, `nope_at_all()` and `NoSuchClass` do not, nor does
`reactor_dist.caller.calls.Nope` or `no_such_file.py`.

```python
runner.not_a_method_but_in_a_fence()
```

Not names: `make test`, `placement="ray"`, `CUDA_VISIBLE_DEVICES`, `world_size`,
`time.monotonic()`, `torch.distributed.all_reduce`, `dist.all_reduce`, `TypeError`,
`.cpu()`, `await runner.astart()`, `stats().restarts`, `reactor_dist.generate` (a span
name), `Bootstrap.group_timeout` (a field), `Inbox.skips` (an instance attribute), and a
span that runs over a line, `python -m
benchmarks.per_call`, before `Gone.name` on the line after it. A property's class:
`runner.last_timings.busy` is, `runner.last_timings.nope` is not; `DistributedRunner(...)`.
"""


def test_the_checker_finds_the_bad_names_of_a_page_and_only_those():
    found = spans(FIXTURE, "page.md")
    assert "runner.not_a_method_but_in_a_fence()" not in [s.code for s in found]
    assert "python -m benchmarks.per_call" in [s.code for s in found]
    assert problems(found) == [
        "page.md:4: `Supervisor.collect`: Supervisor has no 'collect'",
        "page.md:5: `nope_at_all()`: no function or method nope_at_all() in the package",
        "page.md:5: `NoSuchClass`: " + NOT_DEFINED.format("NoSuchClass"),
        "page.md:6: `reactor_dist.caller.calls.Nope`: reactor_dist.caller.calls has no 'Nope'",
        "page.md:6: `no_such_file.py`: no such file in reactor_dist/, tests/, benchmarks/, "
        "workers/, examples/",
        "page.md:17: `Gone.name`: " + NOT_DEFINED.format("Gone"),
        "page.md:18: `runner.last_timings.nope`: CallTimings has no 'nope'",
    ]


@pytest.mark.parametrize("code", sorted(ALLOWED))
def test_each_allowed_span_says_why(code):
    assert len(ALLOWED[code]) > 20


# The glossary (docs/design/index.md) gives one word per concept; these are its
# rejected synonyms for a call that nobody takes any more ("left").
REJECTED = re.compile(r"\babandon\w*|\bnobody waits\b|\bunattended\b", re.I)


def test_one_word_for_a_call_nobody_takes():
    root = pathlib.Path(__file__).resolve().parents[1]
    found = []
    for path in [*sorted((root / "reactor_dist").rglob("*.py")),
                 *sorted((root / "docs").rglob("*.md")), root / "README.md"]:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if REJECTED.search(line) and "Words not used for it" not in line:
                found.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    assert found == []
