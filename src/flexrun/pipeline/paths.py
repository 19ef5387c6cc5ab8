"""Where a pipeline may write: every path it names stays strictly below the run directory.

Owns the three checks that keep a pipeline spec from reaching outside its run directory
(issue 18: a ``checkpointDir`` of ``/`` or ``.`` must never be wiped):

- :func:`check_relative` at parse time, on the text alone: no absolute path, no ``..``,
  nothing that names the run directory itself (``.``, ``""``).
- :func:`resolve_below` before a run, on the real directory: after ``resolve()``
  (symlinks followed) the path is still strictly below the resolved run directory.
- :func:`remove_below`, the only removal the runner does: the same check again at the
  moment of removal (a symlink planted meanwhile), and never the run directory itself.

Every refusal is a :class:`~flexrun.errors.SpecError` naming the field. It does not know
the spec's layout (``spec``) nor when things run (``runner``).
"""

from __future__ import annotations

import shutil
from pathlib import Path, PurePosixPath

from flexrun.errors import SpecError


def check_relative(path: str, where: str) -> str:
    """``path`` as a normalized run-directory-relative path.

    Raises:
        SpecError: absolute, containing ``..``, or naming the run directory itself.
    """
    p = PurePosixPath(path)
    if p.is_absolute():
        raise SpecError(
            f"{where}: {path!r} must be relative to the run directory (absolute paths are "
            "refused: the runner may remove this path)"
        )
    if ".." in p.parts:
        raise SpecError(f"{where}: {path!r} must stay inside the run directory (no '..')")
    if not [part for part in p.parts if part != "."]:
        raise SpecError(
            f"{where}: {path!r} names the run directory itself; use a directory below it"
        )
    return p.as_posix()


def resolve_below(root: Path, path: str, where: str) -> Path:
    """``root / path`` resolved (symlinks followed), checked to be strictly below ``root``.

    Raises:
        SpecError: the resolved path is ``root`` itself or outside it (a symlink out).
    """
    base = root.resolve()
    full = (base / path).resolve()
    if full == base or base not in full.parents:
        raise SpecError(
            f"{where}: {path!r} resolves to {full}, which is not inside the run directory "
            f"{base} (a symlink out of it?); refusing to use it"
        )
    return full


def remove_below(root: Path, path: str, where: str) -> bool:
    """Remove the directory tree at ``root / path``, only if it is strictly below ``root``.

    A symlink at ``path`` itself is removed as a link (what it points to is left alone).
    Returns whether anything was removed.

    Raises:
        SpecError: the path is (or resolves to) ``root`` or something outside it.
    """
    check_relative(path, where)
    target = resolve_below(root, path, where)
    link = root.resolve() / path
    if link.is_symlink():
        link.unlink()
        return True
    if not target.exists():
        return False
    if target.is_dir():
        shutil.rmtree(target)
    else:
        target.unlink()
    return True


__all__ = ["check_relative", "remove_below", "resolve_below"]
