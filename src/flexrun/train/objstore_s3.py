"""S3 (and S3-compatible stores: MinIO, Ceph, moto) as a checkpoint object store, through s3fs.

Owns what S3 adds to :class:`flexrun.train.objstore.FsspecObjectStore`: conditional PUTs
(``If-None-Match: *``, ``If-Match: <etag>``; AWS since 2024, MinIO, moto 5) checked by
the server, uploads completed with ``If-None-Match: *``, conditional deletes, and listing
and aborting incomplete multipart uploads. A store that ignores the condition headers
(an old S3-compatible server) silently degrades fencing to best-effort.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flexrun.errors import PreconditionFailed
from flexrun.train.objstore import FsspecObjectStore, _translate


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
