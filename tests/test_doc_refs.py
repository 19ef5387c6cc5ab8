"""No document or docstring names a file of the repository that does not exist.

Read: README.md, CONTRIBUTING.md, SECURITY.md, docs/**/*.md, bench/**/*.md, tests/**/*.md,
and the docstrings (every string statement) and comments of the Python files in src/, tests/
and bench/ (code's own string literals are data, not references, and are not read).

A reference is, in that text:

- a markdown link to a local target, ``[text](path)`` (markdown files; resolved from the
  file's directory, an ``#anchor`` dropped);
- a path from the repository's root that starts with one of its top directories
  (``src/``, ``tests/``, ``bench/``, ``docs/``, ``examples/``, ``.ci/``), backticked or not;
- a backticked path inside the package, ``agent/spec.py`` or ``flexrun/k8s/schemas/``
  (resolved under ``src/flexrun``);
- a document's name in capitals, ``SECURITY.md`` (it must exist somewhere in the tree).

Placeholders are not references: a path with ``<...>``, ``*``, ``{...}`` or ``$`` in it
(``logs/round_<n>/``) is a pattern, and a path glued to a longer one (``/tmp/docs/x``) is
someone else's. Prose (``and/or``, ``s/round/watcher``, ``kubeflow.org/v1``) never starts
with a top directory or a package directory inside backticks, so it is not read as a path.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "src" / "flexrun"

TOP_DIRS = ("src", "tests", "bench", "docs", "examples", ".ci")
PKG_DIRS = tuple(sorted(p.name for p in PKG.iterdir() if p.is_dir() and p.name != "__pycache__"))
SKIP_DIRS = {".git", "__pycache__", "site", ".mypy_cache", ".ruff_cache", ".pytest_cache"}

_TEMPLATE = re.compile(r"[<>*{}$\[\]]")
_LINK = re.compile(r"\[[^\]\n]*\]\(\s*([^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")
_ROOTED = re.compile(
    r"(?<![\w./\-<>{}$*])((?:" + "|".join(re.escape(d) for d in TOP_DIRS) + r")/[\w.\-/]*)"
    r"([<>*{}$\[]?)"
)
_BACKTICKED = re.compile(r"``?([^`\s]+)``?")
_IN_PKG = re.compile(r"^(?:flexrun/)?(?:" + "|".join(map(re.escape, PKG_DIRS)) + r")/[\w.\-/]*$")
_CAPS_DOC = re.compile(r"(?<![\w/.\-])([A-Z][A-Z0-9_]+\.md)\b")


def _tree_names() -> set[str]:
    names = set()
    for p in ROOT.rglob("*"):
        if not SKIP_DIRS.intersection(p.relative_to(ROOT).parts):
            names.add(p.name)
    return names


def _exists(path: Path) -> bool:
    return path.exists()


def references(text: str, where: Path, markdown: bool) -> Iterator[tuple[str, Path | None]]:
    """Every reference in ``text`` (a file in directory ``where``): (as written, where it
    must exist), or (name, None) for a capitalised document name found by name."""
    if markdown:
        for m in _LINK.finditer(text):
            target = m.group(1).split("#", 1)[0]
            if not target or re.match(r"^[a-z][a-z0-9+.\-]*:", target) or _TEMPLATE.search(target):
                continue
            yield m.group(1), (where / target)
    for m in _ROOTED.finditer(text):
        if m.group(2):  # a pattern: logs/round_<n>, bench/results/*.txt
            continue
        path = m.group(1).rstrip(".,;:")
        yield path, ROOT / path
    for m in _BACKTICKED.finditer(text):
        token = m.group(1).rstrip(".,;:")
        if _IN_PKG.match(token) and not _TEMPLATE.search(token):
            yield token, (ROOT / "src" / token if token.startswith("flexrun/") else PKG / token)
    for m in _CAPS_DOC.finditer(text):
        yield m.group(1), None


def python_prose(source: str) -> str:
    """The docstrings (every string statement) and comments of a Python file, one text."""
    parts = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            parts.append(node.value.value)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            parts.append(tok.string)
    return "\n".join(parts)


def dangling(files: list[Path]) -> list[str]:
    """``file: reference`` for every reference in ``files`` whose file does not exist."""
    names = _tree_names()
    out = []
    for f in files:
        markdown = f.suffix == ".md"
        text = f.read_text(encoding="utf-8")
        if not markdown:
            text = python_prose(text)
        for ref, target in references(text, f.parent, markdown):
            ok = ref in names if target is None else _exists(target)
            if not ok:
                out.append(f"{f.relative_to(ROOT) if f.is_relative_to(ROOT) else f}: {ref}")
    return out


def checked_files() -> list[Path]:
    files = [ROOT / n for n in ("README.md", "CONTRIBUTING.md", "SECURITY.md")]
    for top, pattern in (("docs", "*.md"), ("bench", "*.md"), ("tests", "*.md"),
                         ("src", "*.py"), ("tests", "*.py"), ("bench", "*.py")):  # fmt: skip
        files += sorted(
            p for p in (ROOT / top).rglob(pattern) if not SKIP_DIRS.intersection(p.parts)
        )
    return files


def test_no_document_or_docstring_names_a_missing_file() -> None:
    files = checked_files()
    assert len(files) > 100, "the checked files were not found"
    missing = dangling(files)
    assert not missing, "references to files that do not exist:\n" + "\n".join(missing)


def test_a_made_up_path_is_caught_in_every_form(tmp_path: Path) -> None:
    doc = tmp_path / "page.md"
    doc.write_text(
        "See [the guide](no-such-guide.md#intro), `src/flexrun/agent/no_such.py`,\n"
        "bench/results/no_such_run.txt, ``rendezvous/no_such.py`` and NO_SUCH_DESIGN.md.\n"
    )
    code = tmp_path / "mod.py"
    code.write_text(
        '"""Owns nothing (see docs/user/no_such_page.md)."""\n'
        "X = 1  # the rule of tests/unit/no_such_test.py\n"
        'Y = "docs/not/a/reference/in/code.md"\n'
    )
    found = dangling([doc, code])
    assert sorted(r.split(": ", 1)[1] for r in found) == sorted([
        "no-such-guide.md#intro",
        "src/flexrun/agent/no_such.py",
        "bench/results/no_such_run.txt",
        "rendezvous/no_such.py",
        "NO_SUCH_DESIGN.md",
        "docs/user/no_such_page.md",
        "tests/unit/no_such_test.py",
    ]), found  # fmt: skip


def test_prose_patterns_and_existing_paths_are_not_flagged(tmp_path: Path) -> None:
    doc = tmp_path / "page.md"
    doc.write_text(
        "Use and/or `s/round/watcher`, `trainer.kubeflow.org/v1alpha1`, `kubeflow.org/v1`,\n"
        "`logs/round_<n>/rank_<r>/stdout.log`, bench/results/*.txt, `/tmp/docs/x.md`,\n"
        "`RUN_DIR/hangs/`, [a site](https://example.com/docs/x.md), [here](#anchor),\n"
        "`src/flexrun/agent/spec.py`, ``agent/spec.py``, `flexrun/k8s/schemas/`, docs/,\n"
        "tests/test_layers.py, and SECURITY.md.\n"
    )
    assert dangling([doc]) == []
