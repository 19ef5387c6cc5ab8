"""What a training script imports, read from its syntax tree without running it.

Owns only that reading: whether the script imports anything beyond the standard library as
it starts (its module-level code, including under ``if``/``try``/``with`` and in class
bodies, decorators and default values, not inside functions) and anywhere at all. The
warm pool's defaults use it (:func:`flexrun.config.build`): a spare's zygote pays
``import torch`` (seconds of CPU) before a worker runs, which only a script that imports
more than the standard library can use, and forking the first workers from it helps only
a script that imports such a module as it starts.

It does not follow the script's own imports (any module outside the standard library may
import torch), and anything it cannot tell counts as beyond the standard library: a file
that is not Python source, a relative import, ``importlib``/``runpy``/``pkgutil``, and
calls to ``__import__``, ``exec`` or ``eval``.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

_DYNAMIC_MODULES = frozenset({"importlib", "runpy", "pkgutil", "zipimport"})
"""Standard modules that import other modules by name: what they reach cannot be read."""
_DYNAMIC_CALLS = frozenset({"__import__", "exec", "eval"})
_MAX_BYTES = 4 << 20
"""Larger files are not parsed (a script is rarely more than a few hundred KB)."""


@dataclass(frozen=True, slots=True)
class ScriptImports:
    """Whether a script reaches beyond the standard library as it starts / anywhere."""

    at_start: bool
    anywhere: bool


BEYOND = ScriptImports(at_start=True, anywhere=True)
"""What an unreadable script is taken to import: more than the standard library."""


def _stdlib(name: str) -> bool:
    top = name.partition(".")[0]
    return top in sys.stdlib_module_names and top not in _DYNAMIC_MODULES


class _Scan(ast.NodeVisitor):
    def __init__(self) -> None:
        self.depth = 0  # > 0 inside a function body (runs only when called)
        self.at_start = False
        self.anywhere = False

    def _found(self) -> None:
        self.anywhere = True
        self.at_start = self.at_start or self.depth == 0

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        # Decorators and default values run when the function is defined; its body later.
        if not isinstance(node, ast.Lambda):
            for d in node.decorator_list:
                self.visit(d)
        for d in (*node.args.defaults, *(k for k in node.args.kw_defaults if k is not None)):
            self.visit(d)
        self.depth += 1
        for part in node.body if isinstance(node.body, list) else [node.body]:
            self.visit(part)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_Import(self, node: ast.Import) -> None:
        if not all(_stdlib(a.name) for a in node.names):
            self._found()

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level or not node.module or not _stdlib(node.module):
            self._found()

    def visit_Call(self, node: ast.Call) -> None:
        if isinstance(node.func, ast.Name) and node.func.id in _DYNAMIC_CALLS:
            self._found()
        self.generic_visit(node)


def read_source(source: str | bytes) -> ScriptImports:
    """What ``source`` imports (:data:`BEYOND` when it does not parse)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):  # not Python source (a NUL byte: ValueError)
        return BEYOND
    scan = _Scan()
    scan.visit(tree)
    return ScriptImports(at_start=scan.at_start, anywhere=scan.anywhere)


def script_imports(path: str | Path) -> ScriptImports:
    """What the script at ``path`` imports (:data:`BEYOND` when it cannot be read)."""
    try:
        with open(path, "rb") as f:
            data = f.read(_MAX_BYTES + 1)
    except OSError:
        return BEYOND
    if len(data) > _MAX_BYTES:
        return BEYOND
    return read_source(data)
