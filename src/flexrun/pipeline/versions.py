"""Versioned model directories: ``v1``, ``v2``, ... and a ``current`` pointer.

Owns the registry layout under one root directory: a version is published by renaming a
complete, fsynced staging directory to the next ``v<N>``; ``current`` is a small file
naming the served version, replaced by atomic rename, so a rollback is a pointer change
and never copies or deletes a model. It does not know what a model contains.
"""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path

from flexrun.errors import ConfigError

CURRENT = "current"
_VERSION = re.compile(r"^v([1-9][0-9]*)$")


def versions(root: Path) -> list[str]:
    """Published versions, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p.name) for p in root.iterdir() if (m := _VERSION.match(p.name))]
    return [name for _, name in sorted(found) if (root / name).is_dir()]


def current(root: Path) -> str | None:
    """The version ``current`` names, or None before the first publish (or when it names
    none: binary, not UTF-8, or not ``v<N>``; the next publish or rollback rewrites it)."""
    try:
        name = (root / CURRENT).read_bytes().decode("utf-8").strip()
    except FileNotFoundError:
        return None
    except UnicodeDecodeError:
        return None
    except OSError as exc:
        raise ConfigError(f"{root / CURRENT}: cannot read ({exc.strerror})") from exc
    return name if _VERSION.match(name) else None


def staging_dir(root: Path) -> Path:
    """A fresh directory to write the next version into, then pass to :func:`publish`."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / f".staging-{uuid.uuid4().hex[:12]}"
    path.mkdir()
    return path


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _point(root: Path, name: str) -> None:
    tmp = root / f".{CURRENT}-{uuid.uuid4().hex[:12]}"
    with tmp.open("w", encoding="utf-8") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / CURRENT)
    _fsync_dir(root)


def publish(root: Path, staging: Path) -> str:
    """Make ``staging`` the next version and point ``current`` at it; returns its name.

    Raises:
        ConfigError: the registry cannot be written.
    """
    try:
        for f in staging.rglob("*"):
            if f.is_file():
                with f.open("rb") as fh:
                    os.fsync(fh.fileno())
        _fsync_dir(staging)
        while True:
            existing = versions(root)
            n = int(existing[-1][1:]) + 1 if existing else 1
            target = root / f"v{n}"
            try:
                # rename() onto an existing empty directory succeeds on POSIX; mkdir first
                # so a concurrent publisher cannot take the same number.
                target.mkdir()
            except FileExistsError:
                continue
            os.replace(staging, target)
            break
        _fsync_dir(root)
        _point(root, target.name)
    except OSError as exc:
        raise ConfigError(f"{root}: cannot publish a model version ({exc.strerror})") from exc
    return target.name


def rollback(root: Path, to: str | None = None) -> tuple[str | None, str]:
    """Point ``current`` at ``to`` (default: the version before the current one).

    Returns ``(previous, new)``.

    Raises:
        ConfigError: no such version, or nothing to roll back to.
    """
    have = versions(root)
    if not have:
        raise ConfigError(f"{root}: no model versions (v1, v2, ...) to roll back to")
    cur = current(root)
    if to is None:
        if cur is None or cur not in have:
            what = "does not name a version" if (root / CURRENT).exists() else "is missing"
            raise ConfigError(f"{root / CURRENT} {what}; name the version to serve with --to")
        idx = have.index(cur)
        if idx == 0:
            raise ConfigError(f"{root}: {cur} is the oldest version; nothing to roll back to")
        to = have[idx - 1]
    if to not in have:
        raise ConfigError(f"{root}: no version {to!r} (have {', '.join(have)})")
    try:
        _point(root, to)
    except OSError as exc:
        raise ConfigError(f"{root / CURRENT}: cannot update ({exc.strerror})") from exc
    return cur, to
