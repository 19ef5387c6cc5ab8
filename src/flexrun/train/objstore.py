"""Object stores for checkpoints, through fsspec: S3 (s3fs), the in-memory filesystem, others.

Owns the object operations the object-store commit protocol (``flexrun.train.commit_object``)
needs, each translated into :class:`~flexrun.errors.CheckpointError` at this I/O boundary:
single-object writes that are conditional where the store can compare and set (S3
``If-None-Match: *`` and ``If-Match: <etag>``, in-process for ``memory://``), streamed
uploads with bounded memory (S3: multipart, ``default_block_size`` bytes a part, aborted
when the upload fails; incomplete uploads listed so a later writer can abort what a
killed one left), listing with sizes and etags, deletion. It does not know what a
checkpoint is, and it never renames: object stores have no atomic rename.

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
import os
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
        """Throw away a failed upload: abort it (fsspec's ``discard``), remove what shows."""
        try:
            discard = getattr(f, "discard", None)
            if discard is not None:
                discard()
            if hasattr(f, "buffer"):
                f.buffer = None  # AbstractBufferedFile: close() must not commit it now
            if not getattr(f, "closed", True):
                f.close()
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


class S3ObjectStore(FsspecObjectStore):
    """S3 and S3-compatible stores through s3fs: conditional PUTs (``If-None-Match``,
    ``If-Match``; AWS since 2024, MinIO, moto 5), multipart uploads of
    ``default_block_size`` bytes a part created with ``If-None-Match: *``, conditional
    deletes, and listing and aborting incomplete multipart uploads."""

    def __init__(self, fs: Any) -> None:
        super().__init__(fs, kind="s3")
        self.conditional = True

    def _call(self, method: str, **kwargs: Any) -> Any:
        from fsspec.asyn import sync

        return sync(self.fs.loop, self.fs._call_s3, method, **kwargs)

    def _split(self, path: str) -> tuple[str, str]:
        bucket, key, _version = self.fs.split_path(path)
        return bucket, key

    def put(
        self, path: str, data: bytes, *, if_absent: bool = False, if_match: str | None = None
    ) -> str:
        bucket, key = self._split(path)
        cond: dict[str, str] = {}
        if if_absent:
            cond["IfNoneMatch"] = "*"
        if if_match is not None:
            cond["IfMatch"] = if_match
        try:
            out = self._call("put_object", Bucket=bucket, Key=key, Body=data, **cond)
        except Exception as exc:
            if cond and _precondition_failed(exc):
                raise PreconditionFailed(f"{self.url(path)}: {exc}") from exc
            raise _translate("write", self.url(path), exc) from exc
        self._invalidate(path)
        return str(out.get("ETag", ""))

    def get(self, path: str) -> tuple[bytes, str] | None:
        from fsspec.asyn import sync

        bucket, key = self._split(path)

        async def fetch() -> tuple[bytes, str]:
            resp = await self.fs._call_s3("get_object", Bucket=bucket, Key=key)
            body = resp["Body"]
            try:
                data = await body.read()
            finally:
                body.close()
            return bytes(data), str(resp.get("ETag", ""))

        try:
            return sync(self.fs.loop, fetch)
        except FileNotFoundError:
            return None
        except Exception as exc:
            raise _translate("read", self.url(path), exc) from exc

    def _open_new(self, path: str) -> Any:
        # "xb": the completing request carries If-None-Match: *, so an upload never
        # replaces an object (keys are unique per writer attempt anyway).
        return self.fs.open(path, "xb")

    def delete_if_match(self, path: str, token: str) -> bool:
        bucket, key = self._split(path)
        try:
            self._call("delete_object", Bucket=bucket, Key=key, IfMatch=token)
        except FileNotFoundError:
            return False
        except Exception as exc:
            if _precondition_failed(exc):
                return False
            raise _translate("delete", self.url(path), exc) from exc
        self._invalidate(path)
        return True

    def incomplete_uploads(self, prefix: str) -> list[tuple[str, str]]:
        bucket, key = self._split(prefix)
        out: list[tuple[str, str]] = []
        marker: dict[str, str] = {}
        for _ in range(10_000):  # bounded pagination
            try:
                resp = self._call(
                    "list_multipart_uploads", Bucket=bucket, Prefix=key.rstrip("/") + "/", **marker
                )
            except Exception as exc:
                raise _translate("list uploads", self.url(prefix), exc) from exc
            out += [(f"{bucket}/{u['Key']}", str(u["UploadId"])) for u in resp.get("Uploads") or []]
            if not resp.get("IsTruncated"):
                break
            marker = {
                "KeyMarker": str(resp.get("NextKeyMarker", "")),
                "UploadIdMarker": str(resp.get("NextUploadIdMarker", "")),
            }
        return out

    def abort_upload(self, path: str, upload_id: str) -> None:
        bucket, key = self._split(path)
        try:
            self._call("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
        except FileNotFoundError:
            return
        except Exception as exc:
            raise _translate("abort upload", self.url(path), exc) from exc


def _precondition_failed(exc: BaseException) -> bool:
    """True when a request failed because its condition did not hold (HTTP 412, or 409
    for a concurrent conditional write on S3)."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        response = getattr(cur, "response", None)
        if isinstance(response, Mapping):
            code = str((response.get("Error") or {}).get("Code", ""))
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            if code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (412, 409):
                return True
        cur = cur.__cause__ or cur.__context__
    return False


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
    s3 = "s3" in protocols or "s3a" in protocols
    store: ObjectStore = S3ObjectStore(fs) if s3 else FsspecObjectStore(fs)
    return store, str(root).rstrip("/") or "/"


STORAGE_OPTIONS_ENV = "FLEXRUN_CHECKPOINT_STORAGE_OPTIONS"
"""Environment variable holding a worker's checkpoint ``storage_options`` as a JSON object
(set by the Kubernetes and pipeline renderers from ``checkpoint.storageOptions``)."""

_SECRET_KEYS = frozenset(
    {
        "key",
        "secret",
        "password",
        "passwd",
        "aws_access_key_id",
        "aws_secret_access_key",
        "aws_session_token",
        "secret_access_key",
        "session_token",
        "account_key",
        "sas_token",
        "client_secret",
        "connection_string",
        "credentials",
    }
)
_TOKEN_MODES = frozenset({"anon", "cloud", "google_default", "browser", "cache"})


def check_no_secrets(options: Mapping[str, Any], where: str) -> None:
    """Refuse ``storage_options`` that carry a credential (they travel in environment
    variables and rendered manifests; credentials belong in the store's own chain: an
    instance or pod identity, a profile, ``AWS_*`` variables from a Secret).

    Raises:
        ConfigError: a key names a credential (``secret``, ``password``, ``sas_token`` ...).
    """
    from flexrun.errors import ConfigError

    def walk(obj: Any, path: str) -> None:
        if isinstance(obj, Mapping):
            for k, v in obj.items():
                name = str(k).lower()
                secret = name in _SECRET_KEYS or name.endswith(("_secret", "_password", "_key_id"))
                if name == "token" and not (isinstance(v, str) and v in _TOKEN_MODES):
                    secret = True
                if secret:
                    raise ConfigError(
                        f"{where}: {path}{k} looks like a credential; never put secrets in "
                        "storage options: use the store's credential chain (pod/instance "
                        "identity, a profile, AWS_* variables from a Kubernetes Secret)"
                    )
                walk(v, f"{path}{k}.")
        elif isinstance(obj, list):
            for i, v in enumerate(obj):
                walk(v, f"{path}{i}.")

    walk(options, "")


def storage_options_from_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The ``storage_options`` a launcher handed this worker in
    ``FLEXRUN_CHECKPOINT_STORAGE_OPTIONS`` (JSON object; empty when unset).

    Raises:
        ConfigError: not a JSON object, or it carries a credential.
    """
    import json

    from flexrun.errors import ConfigError

    env = os.environ if environ is None else environ
    raw = env.get(STORAGE_OPTIONS_ENV, "").strip()
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise ConfigError(f"{STORAGE_OPTIONS_ENV} is not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ConfigError(
            f"{STORAGE_OPTIONS_ENV} must be a JSON object, got {type(value).__name__}"
        )
    check_no_secrets(value, STORAGE_OPTIONS_ENV)
    return value
