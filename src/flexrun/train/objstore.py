"""Object stores for checkpoints, through fsspec: S3 (s3fs), the in-memory filesystem, others.

Owns the object operations the object-store commit protocol (``flexrun.train.commit_object``)
needs, each translated into :class:`~flexrun.errors.CheckpointError` at this I/O boundary:
single-object writes that are conditional where the store can compare and set (S3
``If-None-Match: *`` and ``If-Match: <etag>``, in-process for ``memory://``), streamed
uploads with bounded memory (S3: multipart, ``default_block_size`` bytes a part, aborted
when the upload fails; incomplete uploads listed so a later writer can abort what a
killed one left), listing with sizes and etags, deletion. It does not know what a
checkpoint is, and it never renames: object stores have no atomic rename.

S3's adapter is ``flexrun.train.objstore_s3``; storage options that come from the
environment (and the refusal of credentials in them) are ``flexrun.storage_options``.

Errors: a store that cannot be reached, times out or fails on its side (5xx) raises
:class:`~flexrun.errors.StorageFailure` (``EIO``), which the Checkpointer counts like a
full disk (training goes on, the next save tries again); access denied, a missing bucket
or a bad option raise a plain CheckpointError; a lost conditional write raises
:class:`~flexrun.errors.PreconditionFailed`.

Stores without compare-and-set (any other fsspec filesystem: GCS and Azure until they
get an adapter here using generation or ETag preconditions) still commit manifest-last,
but their fencing is best-effort: the condition is checked just before the write.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from flexrun.errors import CheckpointError, PreconditionFailed, StorageFailure
from flexrun.train.pacing import HashingWriter, PieceWriter

log = logging.getLogger(__name__)

_PIECE = 4 << 20


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    size: int
    token: str
    """What changes when the object is replaced (ETag, generation, creation time)."""


class ObjectStore(Protocol):
    """Object operations on paths of one filesystem (``bucket/key`` for S3). Every method
    raises CheckpointError (StorageFailure when the store failed or was unreachable)."""

    kind: str
    conditional: bool
    """True when ``put``'s conditions are checked atomically by the store."""

    def url(self, path: str) -> str:
        """``path`` with its protocol (``s3://bucket/key``), for DCP and messages."""
        ...

    def join(self, *parts: str) -> str: ...

    def put(
        self, path: str, data: bytes, *, if_absent: bool = False, if_match: str | None = None
    ) -> str:
        """Write one small object in one request; return its token.

        Raises:
            PreconditionFailed: ``if_absent`` and it exists, or ``if_match`` and it changed.
        """
        ...

    def get(self, path: str) -> tuple[bytes, str] | None:
        """Content and token of ``path``, or None when it does not exist."""
        ...

    def upload(self, path: str, writer: Callable[[Any], object]) -> tuple[int, str]:
        """Stream ``writer``'s bytes to a new object ``path``; return (size, sha256) once
        the object is there with that size. On any failure nothing is left at ``path``
        and no upload stays open."""
        ...

    def read_chunks(self, path: str) -> Iterator[bytes]: ...

    def listing(self, prefix: str) -> dict[str, ObjectInfo]:
        """Every object below ``prefix`` (recursive), by path relative to it."""
        ...

    def children(self, prefix: str) -> list[str]:
        """Names directly below ``prefix`` (objects and sub-prefixes)."""
        ...

    def delete(self, paths: list[str]) -> None:
        """Delete objects (missing ones are fine)."""
        ...

    def delete_if_match(self, path: str, token: str) -> bool:
        """Delete ``path`` only if it is still the object ``token`` names (where the store
        can; else after a check); False when it changed."""
        ...

    def incomplete_uploads(self, prefix: str) -> list[tuple[str, str]]:
        """(path, upload id) of uploads begun below ``prefix`` and never completed."""
        ...

    def abort_upload(self, path: str, upload_id: str) -> None: ...


def _translate(what: str, path: str, exc: BaseException) -> CheckpointError:
    """The CheckpointError for a failed object operation (see the module docstring)."""
    if isinstance(exc, CheckpointError):
        return exc
    detail = f"{type(exc).__name__}: {exc}"
    message = f"checkpoint {what} failed for {path}: {detail}"
    if isinstance(
        exc, (PermissionError, FileNotFoundError, IsADirectoryError, ValueError, TypeError)
    ):
        return CheckpointError(message)
    if isinstance(exc, OSError) and exc.errno == errno.EINVAL:
        return CheckpointError(message)
    code = (
        exc.errno
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)
        else errno.EIO
    )
    return StorageFailure(message, code)


def _token_of(info: Mapping[str, Any]) -> str:
    for k in (
        "ETag",
        "etag",
        "generation",
        "md5Hash",
        "mtime",
        "LastModified",
        "modified",
        "created",
    ):
        if info.get(k) is not None:
            return str(info[k])
    return ""


class FsspecObjectStore:
    """Any fsspec filesystem treated as an object store (never renamed in).

    Conditions are checked in-process under a lock, which is atomic for ``memory://`` (its
    objects live in this process) and best-effort anywhere else.
    """

    _lock = threading.Lock()

    def __init__(self, fs: Any, *, kind: str | None = None) -> None:
        self.fs = fs
        protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        self.kind = kind or str(protocol)
        self.conditional = self.kind == "memory"

    def url(self, path: str) -> str:
        return str(self.fs.unstrip_protocol(path))

    def join(self, *parts: str) -> str:
        return "/".join(p.strip("/") if i else p.rstrip("/") for i, p in enumerate(parts) if p)

    def _invalidate(self, path: str) -> None:
        try:
            self.fs.invalidate_cache(path)
        except Exception as exc:  # a cache it does not have: nothing to drop
            log.debug("invalidate_cache(%s): %s", path, exc)

    def put(
        self, path: str, data: bytes, *, if_absent: bool = False, if_match: str | None = None
    ) -> str:
        with self._lock:
            current = self.get(path) if (if_absent or if_match is not None) else None
            if if_absent and current is not None:
                raise PreconditionFailed(f"{self.url(path)} exists")
            if if_match is not None and (current is None or current[1] != if_match):
                raise PreconditionFailed(f"{self.url(path)} changed since it was read")
            try:
                self.fs.pipe_file(path, data)
            except Exception as exc:
                raise _translate("write", self.url(path), exc) from exc
            self._invalidate(path)
            return hashlib.sha256(data).hexdigest()

    def get(self, path: str) -> tuple[bytes, str] | None:
        try:
            data = bytes(self.fs.cat_file(path))
        except FileNotFoundError:
            return None
        except Exception as exc:
            raise _translate("read", self.url(path), exc) from exc
        return data, hashlib.sha256(data).hexdigest()

    def upload(self, path: str, writer: Callable[[Any], object]) -> tuple[int, str]:
        try:
            f = self._open_new(path)
        except Exception as exc:
            raise _translate("write", self.url(path), exc) from exc
        hw = HashingWriter(PieceWriter(f, _PIECE))  # type: ignore[arg-type]
        try:
            writer(hw)
            f.close()
        except BaseException as exc:
            self._discard(f, path)
            cause = hw.error if hw.error is not None else exc
            if isinstance(exc, Exception):
                raise _translate("write", self.url(path), cause) from exc
            raise
        self._invalidate(path)
        try:
            size = int(self.fs.info(path)["size"])
        except Exception as exc:
            raise _translate("verify", self.url(path), exc) from exc
        if size != hw.size:
            self.delete([path])
            raise CheckpointError(
                f"checkpoint upload of {self.url(path)} is {size} bytes on the store, "
                f"{hw.size} were written"
            )
        return hw.size, hw.sha256.hexdigest()

    def _open_new(self, path: str) -> Any:
        return self.fs.open(path, "wb")

    def _discard(self, f: Any, path: str) -> None:
        """Throw away a failed upload: abort it (fsspec's ``discard``: S3 aborts the
        multipart upload), never commit it, remove whatever shows at ``path``."""
        try:
            discard = getattr(f, "discard", None)
            if discard is not None:
                discard()
            if hasattr(f, "buffer"):  # AbstractBufferedFile: closing would commit it
                f.buffer = None
                f.closed = True
        except Exception as exc:  # the write's own error is the one raised
            log.warning("could not abort the upload of %s: %s", self.url(path), exc)
        try:
            self._invalidate(path)
            if self.fs.exists(path):
                self.fs.rm(path)
        except Exception as exc:
            log.warning("could not remove the partial object %s: %s", self.url(path), exc)

    def read_chunks(self, path: str) -> Iterator[bytes]:
        self._invalidate(path)  # never read with a cached size or etag of a replaced object
        try:
            fh = self.fs.open(path, "rb")
        except FileNotFoundError as exc:
            raise CheckpointError(f"{self.url(path)}: object missing") from exc
        except Exception as exc:
            raise _translate("read", self.url(path), exc) from exc
        return self._chunks(fh, path)

    def _chunks(self, fh: Any, path: str) -> Iterator[bytes]:
        with fh:
            while True:
                try:
                    chunk = fh.read(_PIECE)
                except Exception as exc:
                    raise _translate("read", self.url(path), exc) from exc
                if not chunk:
                    return
                yield bytes(chunk)

    def listing(self, prefix: str) -> dict[str, ObjectInfo]:
        self._invalidate(prefix)
        try:
            found = self.fs.find(prefix, detail=True)
        except FileNotFoundError:
            return {}
        except Exception as exc:
            raise _translate("list", self.url(prefix), exc) from exc
        base = prefix.rstrip("/") + "/"
        out = {}
        for name, info in found.items():
            name = str(name)
            if name.startswith(base) and info.get("type", "file") != "directory":
                out[name[len(base) :]] = ObjectInfo(int(info.get("size") or 0), _token_of(info))
        return out

    def children(self, prefix: str) -> list[str]:
        self._invalidate(prefix)
        try:
            names = self.fs.ls(prefix, detail=False)
        except FileNotFoundError:
            return []
        except Exception as exc:
            raise _translate("list", self.url(prefix), exc) from exc
        return sorted({str(n).rstrip("/").rsplit("/", 1)[-1] for n in names} - {""})

    def delete(self, paths: list[str]) -> None:
        if not paths:
            return
        try:
            self.fs.rm(list(paths))
        except FileNotFoundError:
            pass
        except Exception as exc:
            raise _translate("delete", self.url(paths[0]), exc) from exc
        for p in paths:
            self._invalidate(p)

    def delete_if_match(self, path: str, token: str) -> bool:
        with self._lock:
            current = self.get(path)
            if current is None or current[1] != token:
                return False
            self.delete([path])
            return True

    def incomplete_uploads(self, prefix: str) -> list[tuple[str, str]]:
        return []  # fsspec has no such listing; GCS/Azure expire abandoned uploads themselves

    def abort_upload(self, path: str, upload_id: str) -> None:
        return None


def open_object_store(
    url: str, storage_options: Mapping[str, Any] | None = None
) -> tuple[ObjectStore, str]:
    """The object store and root path (without protocol) for an fsspec URL.

    Raises:
        CheckpointError: no fsspec filesystem for the URL (its package is not installed,
            e.g. ``pip install flexrun[s3]``), or the options are refused.
    """
    try:
        import fsspec
    except ImportError as exc:  # a core dependency; only a broken install lacks it
        raise CheckpointError(f"{url}: URLs need fsspec (pip install fsspec)") from exc
    try:
        fs, root = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
    except ImportError as exc:
        raise CheckpointError(
            f"{url}: the fsspec backend for this URL is not installed ({exc}); "
            "for s3:// install flexrun[s3]"
        ) from exc
    except (ValueError, TypeError) as exc:
        raise CheckpointError(
            f"{url}: no fsspec filesystem for this URL and options: {exc}"
        ) from exc
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    store: ObjectStore
    if "s3" in protocols or "s3a" in protocols:
        from flexrun.train.objstore_s3 import S3ObjectStore

        store = S3ObjectStore(fs)
    else:
        store = FsspecObjectStore(fs)
    return store, str(root).rstrip("/") or "/"
