"""A worker class the ranks cannot find because the script defines it under its
``if __name__ == "__main__":`` guard (issue 46).

Each rank runs the user's script again as ``__mp_main__`` to find the worker class
(:func:`reactor_dist.worker.import_worker_class`); the guard's block is skipped there, so
a class defined only inside it exists in the caller and in no rank.  At construction
the script's source tells it (:func:`check_defined_where_ranks_run`); where the source
cannot tell (a class made under some other condition), the rank says so at ``start()``
(:func:`not_found`).
"""

from __future__ import annotations

import ast
import importlib.util

from .wire.protocol import WorkerRef

FIX = ("Define the worker class at the top level of the script, above the guard (or in a "
       "module the script imports); keep only the code that builds and uses the runner "
       "under `if __name__ == \"__main__\":`")


def _is_main_guard(test: ast.expr) -> bool:
    """``__name__ == "__main__"`` (either way round)."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1
            and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    return any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides) and \
        any(isinstance(s, ast.Constant) and s.value == "__main__" for s in sides)


def _binds(node: ast.stmt, name: str) -> bool:
    """Whether the statement ``node`` itself binds ``name`` at the level it runs in."""
    if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        return node.name == name
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return any((a.asname or a.name.split(".")[0]) == name or a.name == "*"
                   for a in node.names)
    targets: list[ast.expr] = []
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        targets = [node.target]
    return any(isinstance(n, ast.Name) and n.id == name
               for t in targets for n in ast.walk(t))


def where_bound(body: list[ast.stmt], name: str, guarded: bool = False) -> set[str]:
    """Where the module's top level binds ``name``: "top" (a rank runs it), "guard"
    (only under the main guard).  Blocks of ``if``, ``try``, ``with``, loops are the top
    level too; function and class bodies are not."""
    found: set[str] = set()
    for node in body:
        if _binds(node, name):
            found.add("guard" if guarded else "top")
        if isinstance(node, ast.If):
            inside = guarded or _is_main_guard(node.test)
            found |= where_bound(node.body, name, inside)
            found |= where_bound(node.orelse, name, guarded)
        elif isinstance(node, (ast.Try, getattr(ast, "TryStar", ast.Try))):
            for block in (node.body, node.orelse, node.finalbody,
                          *[h.body for h in node.handlers]):
                found |= where_bound(block, name, guarded)
        elif isinstance(node, (ast.With, ast.AsyncWith, ast.For, ast.AsyncFor, ast.While)):
            found |= where_bound(node.body, name, guarded)
            found |= where_bound(getattr(node, "orelse", []), name, guarded)
    return found


def script_of(where: WorkerRef) -> str | None:
    """The file a rank runs again to find ``where``'s class (None: not a script)."""
    if where.main_path is not None:
        return str(where.main_path)
    if where.main_module is not None:
        try:
            spec = importlib.util.find_spec(where.main_module)
        except (ImportError, ValueError):
            return None
        return spec.origin if spec is not None and spec.has_location else None
    return None


def check_defined_where_ranks_run(where: WorkerRef) -> None:
    """At construction: TypeError when the script defines the worker class only under
    its main guard, which the ranks skip (an unreadable script is left to start())."""
    if where.module != "__main__":
        return
    script = script_of(where)
    if script is None:
        return
    try:
        with open(script, "rb") as f:
            tree = ast.parse(f.read(), script)
    except (OSError, SyntaxError, ValueError):
        return
    if where_bound(tree.body, where.qualname.split(".")[0]) == {"guard"}:
        raise TypeError(
            f"worker class {where.qualname} is defined under `if __name__ == "
            f"\"__main__\":` in {script}, which the rank processes skip: each rank runs "
            f"the script again (as __mp_main__) to find the class, and the guard keeps "
            f"that block from running there. {FIX}")


def not_found(where: WorkerRef) -> TypeError:
    """In a rank: the error for a worker class its module (or the script run again)
    does not define."""
    if where.module == "__main__":
        script = script_of(where) or where.main_module or "your script"
        return TypeError(
            f"worker class {where.qualname} was not found when this rank ran your script "
            f"{script} again (as __mp_main__) to find it: the script defines it only where "
            f"the ranks do not run, such as under `if __name__ == \"__main__\":` or in a "
            f"branch taken only in your process. {FIX}")
    return TypeError(
        f"worker class {where.qualname} was not found when this rank imported its module "
        f"{where.module!r}: the module defines it only where the ranks do not run (a "
        f"branch taken only in your process?). Define it at the module's top level")
