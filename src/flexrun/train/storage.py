"""Where checkpoint bytes live on a filesystem with real directories: local or shared POSIX.

Owns the handful of file operations the POSIX commit protocol (``flexrun.train.commit``)
needs, each translated into :class:`~flexrun.errors.CheckpointError` at this I/O boundary
(:class:`~flexrun.errors.StorageFailure` when the storage refused: full, read-only,
failing). Local paths get ``fsync`` on every file and directory and POSIX ``rename``
(atomic; a directory rename never replaces a non-empty directory). It does not know what
a checkpoint is. Object stores (``s3://``, ``gs://``, ``memory://`` ... through fsspec)
have no rename: they live in ``flexrun.train.objstore`` with their own protocol.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from flexrun.errors import CheckpointError, StorageFailure
from flexrun.train.pacing import (
    CpuPacer,
    HashingWriter,
    PacedWriter,
    PieceWriter,
    ThrottledWriter,
)

__all__ = [
    "STORAGE_ERRNOS",
    "CpuPacer",
    "HashingWriter",
    "LocalStorage",
    "PacedWriter",
    "PieceWriter",
    "Storage",
    "StorageFailure",
    "ThrottledWriter",
    "fsync_dir",
    "open_storage",
    "storage_error",
]

log = logging.getLogger(__name__)

STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS})
"""Errors that say the storage refused the bytes (full, over quota, failing, read-only),
not that the checkpoint or the program is wrong: a later save may well succeed."""


class Storage(Protocol):
    """File operations of the commit protocol. Every method raises ``CheckpointError``
    (:class:`StorageFailure` when the storage itself refused: full, read-only, failing)."""

    def write_file(self, path: str, writer: Any) -> tuple[int, str]:
        """Create ``path``, call ``writer(fileobj)``, make it durable; return (size, sha256).

        Raises:
            StorageFailure: the storage refused it (``ENOSPC``, ``EIO`` ...); nothing is
                left at ``path``.
            CheckpointError: the write or the sync failed otherwise.
        """
        ...

    def read_bytes(self, path: str) -> bytes:
        """Whole content of ``path``.

        Raises:
            CheckpointError: missing or unreadable.
        """
        ...

    def read_chunks(self, path: str) -> Iterator[bytes]:
        """Content of ``path`` in pieces (a bounded amount in memory at a time).

        Raises:
            CheckpointError: missing or unreadable.
        """
        ...

    def fingerprint(self, path: str) -> tuple[Any, ...]:
        """Identity of the files below directory ``path`` (names, sizes, mtimes, inodes):
        changes whenever one of them is replaced or written.

        Raises:
            CheckpointError: cannot be listed.
        """
        ...

    def list_dir(self, path: str) -> list[str]:
        """Base names in directory ``path`` (empty if it does not exist).

        Raises:
            CheckpointError: the directory exists but cannot be listed.
        """
        ...

    def makedirs(self, path: str) -> None:
        """Create ``path`` and parents.

        Raises:
            CheckpointError: cannot create.
        """
        ...

    def rename(self, src: str, dst: str, *, replace: bool) -> None:
        """Move ``src`` to ``dst``, atomically where the filesystem allows, and make it durable.

        With ``replace=False`` an existing ``dst`` is an error, never overwritten.

        Raises:
            CheckpointError: the move failed or ``dst`` exists and ``replace`` is false.
        """
        ...

    def remove_tree(self, path: str) -> None:
        """Delete ``path`` recursively; a missing path is fine.

        Raises:
            CheckpointError: deletion failed.
        """
        ...

    def join(self, *parts: str) -> str:
        """Join path components the way this filesystem does."""
        ...


def storage_error(what: str, path: str, exc: BaseException) -> CheckpointError:
    """The CheckpointError for a failed ``what`` on ``path``: a StorageFailure when the
    errno says the storage refused (``STORAGE_ERRNOS``)."""
    return _fail(what, path, exc)


def _fail(what: str, path: str, exc: BaseException) -> CheckpointError:
    detail = os.strerror(exc.errno) if isinstance(exc, OSError) and exc.errno else str(exc)
    message = f"checkpoint {what} failed for {path}: {detail}"
    if isinstance(exc, OSError) and exc.errno in STORAGE_ERRNOS:
        return StorageFailure(message, exc.errno)
    return CheckpointError(message)


def _discard_partial(remove: Callable[[], None], path: str) -> None:
    """Remove what a failed write left at ``path``; a failure to do so is logged (the
    write's own error is the one raised)."""
    try:
        remove()
    except FileNotFoundError:
        return
    except Exception as exc:  # the storage is failing: the caller raises the first error
        log.warning("could not remove the partial checkpoint file %s: %s", path, exc)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStorage:
    """A directory on a local or shared POSIX filesystem."""

    def write_file(self, path: str, writer: Any) -> tuple[int, str]:
        hw: HashingWriter | None = None
        try:
            with open(path, "wb", buffering=1 << 20) as raw:
                hw = HashingWriter(raw)
                writer(hw)
                raw.flush()
                os.fsync(raw.fileno())
            fsync_dir(os.path.dirname(path) or ".")
            return hw.size, hw.sha256.hexdigest()
        except CheckpointError:
            raise
        except Exception as exc:  # OSError, or a serializer's rewrap of one
            cause = hw.error if hw is not None and hw.error is not None else exc
            if hw is not None:  # the file was created: leave nothing torn behind
                _discard_partial(lambda: os.unlink(path), path)
            raise _fail("write", path, cause) from exc

    def read_bytes(self, path: str) -> bytes:
        try:
            with open(path, "rb") as fh:
                return fh.read()
        except OSError as exc:
            raise _fail("read", path, exc) from exc

    def read_chunks(self, path: str) -> Iterator[bytes]:
        try:
            fh = open(path, "rb")  # noqa: SIM115  (closed by the generator)
        except OSError as exc:
            raise _fail("read", path, exc) from exc
        return _chunks(fh, path)

    def fingerprint(self, path: str) -> tuple[Any, ...]:
        out = []
        try:
            for dirpath, _dirs, files in os.walk(path):
                for f in sorted(files):
                    st = os.stat(os.path.join(dirpath, f))
                    rel = os.path.relpath(os.path.join(dirpath, f), path)
                    out.append((rel, st.st_size, st.st_mtime_ns, st.st_ino))
        except OSError as exc:
            raise _fail("stat", path, exc) from exc
        return tuple(sorted(out))

    def list_dir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise _fail("list", path, exc) from exc

    def makedirs(self, path: str) -> None:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as exc:
            raise _fail("mkdir", path, exc) from exc

    def rename(self, src: str, dst: str, *, replace: bool) -> None:
        try:
            if replace:
                os.replace(src, dst)
            else:
                if os.path.lexists(dst):
                    raise OSError(errno.EEXIST, os.strerror(errno.EEXIST), dst)
                os.rename(src, dst)
            fsync_dir(os.path.dirname(dst) or ".")
        except OSError as exc:
            raise _fail("rename", f"{src} -> {dst}", exc) from exc

    def remove_tree(self, path: str) -> None:
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            elif os.path.lexists(path):
                os.unlink(path)
        except OSError as exc:
            raise _fail("remove", path, exc) from exc

    def join(self, *parts: str) -> str:
        return os.path.join(*parts)


def _chunks(fh: Any, path: str, piece: int = 4 << 20) -> Iterator[bytes]:
    with fh:
        while True:
            try:
                chunk = fh.read(piece)
            except OSError as exc:
                raise _fail("read", path, exc) from exc
            if not chunk:
                return
            yield chunk


def open_storage(url: str | os.PathLike[str]) -> tuple[Storage, str]:
    """POSIX storage and absolute root for a local path or ``file://`` URL.

    Raises:
        CheckpointError: ``url`` names another scheme (those are object stores:
            ``flexrun.train.objstore``).
    """
    text = os.fspath(url)
    if "://" in text and not text.startswith("file://"):
        raise CheckpointError(f"{text}: not a local path (object stores: flexrun.train.objstore)")
    root = text[len("file://") :] if text.startswith("file://") else text
    return LocalStorage(), os.path.abspath(root)
