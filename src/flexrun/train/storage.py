"""Where checkpoint bytes live: the local filesystem (with real fsyncs) or any fsspec URL.

Owns the handful of file operations the commit protocol needs, each translated into
:class:`~flexrun.errors.CheckpointError` at this I/O boundary. It does not know what a
checkpoint is (``flexrun.train.commit`` does). Local paths get ``fsync`` on every file
and directory and POSIX ``rename`` (atomic; a directory rename never replaces a
non-empty directory). fsspec filesystems (``memory://``, ``s3://`` ...) get their own
``mv``; object stores have no atomic directory rename, so there the manifest written
last inside the directory is what makes a checkpoint count (the loader verifies it).
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from typing import Any, BinaryIO, Protocol

from flexrun._clock import Clock
from flexrun.errors import CheckpointError

log = logging.getLogger(__name__)

STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS})
"""Errors that say the storage refused the bytes (full, over quota, failing, read-only),
not that the checkpoint or the program is wrong: a later save may well succeed."""


class StorageFailure(CheckpointError):
    """A checkpoint file operation failed because of the storage (see ``STORAGE_ERRNOS``).

    The Checkpointer counts these instead of stopping training (``max_failed_saves``).
    """

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.errno = code

    @property
    def reason(self) -> str:
        """The errno's symbolic name (``ENOSPC``, ``EIO`` ...)."""
        return errno.errorcode.get(self.errno, str(self.errno))


class HashingWriter:
    """A write-only file object that hashes and counts what passes through it."""

    def __init__(self, raw: BinaryIO) -> None:
        self._raw = raw
        self.sha256 = hashlib.sha256()
        self.size = 0
        self.error: OSError | None = None
        """The first I/O error, kept because serializers (torch's zip writer) may rewrap it."""

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.sha256.update(view)
        try:
            written = self._raw.write(view)
        except OSError as exc:
            self.error = self.error or exc
            raise
        n = len(view) if written is None else written
        self.size += n
        return n

    def flush(self) -> None:
        self._raw.flush()


class ThrottledWriter:
    """Caps the average write rate (bytes/s) in 4 MiB pieces, so a background persist
    takes a bounded share of CPU and memory bandwidth from training."""

    _PIECE = 4 << 20

    def __init__(self, raw: Any, rate: float, clock: Clock) -> None:
        self._raw, self._rate, self._clock = raw, rate, clock
        self._start = clock.monotonic()
        self._sent = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        for i in range(0, len(view), self._PIECE):
            piece = view[i : i + self._PIECE]
            self._raw.write(piece)
            self._sent += len(piece)
            ahead = self._sent / self._rate - (self._clock.monotonic() - self._start)
            if ahead > 0:
                self._clock.sleep(ahead)
        return len(view)

    def flush(self) -> None:
        self._raw.flush()


class CpuPacer:
    """Keeps a background thread's CPU use near a share of one core: after each piece of
    work it rests for the CPU time the piece took times ``1/share - 1``.

    The measure is the calling thread's own CPU time, so time the thread spends waiting
    for a core (training has it) does not lengthen the rests, and nothing accumulates as
    credit for a later burst. :meth:`hurry` ends the pacing (a caller waits for the
    result); a rest in progress ends within ``_SLICE_S``.

    Call :meth:`start` and :meth:`pace` from the paced thread.
    """

    _SLICE_S = 0.05
    _MAX_REST_S = 1.0
    """One piece never earns a longer rest (a piece that took that long was preempted)."""

    def __init__(
        self,
        share: float,
        clock: Clock,
        *,
        cpu_time: Callable[[], float] = time.thread_time,
    ) -> None:
        """
        Args:
            share: CPU share of one core, ``0 < share <= 1`` (1: never rests).
            clock: what the rests sleep on.
            cpu_time: the calling thread's CPU seconds (injected by tests).

        Raises:
            CheckpointError: ``share`` out of range.
        """
        if not 0 < share <= 1:
            raise CheckpointError(f"persist CPU share must be in (0, 1], got {share}")
        self._factor = 1.0 / share - 1.0
        self._clock = clock
        self._cpu_time = cpu_time
        self._hurry = threading.Event()
        self._mark: float | None = None
        self.rested_s = 0.0
        """Total rest so far (seconds on ``clock``)."""

    def start(self) -> None:
        self._mark = self._cpu_time()

    def pace(self) -> None:
        """Rest in proportion to the CPU time used since :meth:`start` or the last call."""
        now = self._cpu_time()
        spent = now - (now if self._mark is None else self._mark)
        rest = min(spent * self._factor, self._MAX_REST_S)
        end = self._clock.monotonic() + rest
        for _ in range(int(rest / self._SLICE_S) + 2):  # bounded; a slice each
            left = end - self._clock.monotonic()
            if left <= 0 or self._hurry.is_set():
                break
            self._clock.sleep(min(left, self._SLICE_S))
            self.rested_s += min(left, self._SLICE_S)
        self._mark = self._cpu_time()  # the rest's own CPU is not work

    def hurry(self) -> None:
        """Stop resting from now on (thread-safe)."""
        self._hurry.set()


class PacedWriter:
    """Writes in pieces through a :class:`CpuPacer`, so hashing and writing each piece
    (the CPU cost of a persist) is spread out instead of taken in one burst."""

    _PIECE = 4 << 20

    def __init__(self, raw: Any, pacer: CpuPacer) -> None:
        self._raw, self._pacer = raw, pacer

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        for i in range(0, len(view), self._PIECE):
            self._raw.write(view[i : i + self._PIECE])
            self._pacer.pace()
        return len(view)

    def flush(self) -> None:
        self._raw.flush()


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


class FsspecStorage:
    """Any fsspec filesystem (``memory://``, ``s3://``, ``gs://`` ...)."""

    def __init__(self, fs: Any) -> None:
        self._fs = fs

    def write_file(self, path: str, writer: Any) -> tuple[int, str]:
        hw: HashingWriter | None = None
        try:
            with self._fs.open(path, "wb") as raw:
                hw = HashingWriter(raw)
                writer(hw)
            return hw.size, hw.sha256.hexdigest()
        except CheckpointError:
            raise
        except Exception as exc:  # fsspec backends raise their own types
            cause = hw.error if hw is not None and hw.error is not None else exc
            if hw is not None:
                _discard_partial(lambda: self._fs.rm(path), path)
            raise _fail("write", path, cause) from exc

    def read_bytes(self, path: str) -> bytes:
        try:
            return bytes(self._fs.cat_file(path))
        except Exception as exc:
            raise _fail("read", path, exc) from exc

    def list_dir(self, path: str) -> list[str]:
        try:
            if not self._fs.exists(path):
                return []
            names = self._fs.ls(path, detail=False)
        except Exception as exc:
            raise _fail("list", path, exc) from exc
        return sorted(str(n).rstrip("/").rsplit("/", 1)[-1] for n in names)

    def makedirs(self, path: str) -> None:
        try:
            self._fs.makedirs(path, exist_ok=True)
        except Exception as exc:
            raise _fail("mkdir", path, exc) from exc

    def rename(self, src: str, dst: str, *, replace: bool) -> None:
        try:
            if self._fs.exists(dst):
                if not replace:
                    raise FileExistsError(errno.EEXIST, "destination exists", dst)
                self._fs.rm(dst, recursive=True)
            self._fs.mv(src, dst, recursive=True)
        except Exception as exc:
            raise _fail("rename", f"{src} -> {dst}", exc) from exc

    def remove_tree(self, path: str) -> None:
        try:
            if self._fs.exists(path):
                self._fs.rm(path, recursive=True)
        except Exception as exc:
            raise _fail("remove", path, exc) from exc

    def join(self, *parts: str) -> str:
        return "/".join(p.rstrip("/") for p in parts)


def open_storage(url: str | os.PathLike[str]) -> tuple[Storage, str]:
    """Storage and root path for a directory or fsspec URL.

    Raises:
        CheckpointError: the URL names a protocol whose fsspec backend is not installed.
    """
    text = os.fspath(url)
    if "://" not in text or text.startswith("file://"):
        root = text[len("file://") :] if text.startswith("file://") else text
        return LocalStorage(), os.path.abspath(root)
    try:
        import fsspec
    except ImportError as exc:
        raise CheckpointError(f"{text}: URLs need fsspec (pip install fsspec)") from exc
    try:
        fs, root = fsspec.core.url_to_fs(text)
    except (ImportError, ValueError) as exc:
        raise CheckpointError(f"{text}: no fsspec filesystem for this URL: {exc}") from exc
    return FsspecStorage(fs), str(root).rstrip("/")
