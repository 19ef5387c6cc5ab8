"""Writers without the job secret, on each backend: a bare ``torch.distributed.TCPStore``
client and etcd's v3 JSON gateway (the API flexrun's etcd client uses), writing raw bytes
under any key. What a stranger who reaches a job's store can do; shared by the fuzz suite
and the integration tests (``test_store_junk.py``)."""

from __future__ import annotations

import base64
import json
import urllib.request
from datetime import timedelta
from typing import Any

ETCD_MAX_KEYS = 10000


class TcpJunk:
    """A bare ``TCPStore`` client (no flexrun encoding, no secret)."""

    def __init__(self, host: str, port: int) -> None:
        import torch.distributed as dist

        self._c = dist.TCPStore(host, port, None, False, timedelta(seconds=10))
        self._host, self._port = host, port

    def keys(self, prefix: str = "") -> list[str]:
        from flexrun.store.tcp_junk import raw_keys

        listed = raw_keys(self._host, self._port, 10.0)  # (list_keys fails on non-UTF-8)
        return [k for k in (b.decode("utf-8", "replace") for b in listed) if k.startswith(prefix)]

    def put(self, key: str | bytes, value: bytes) -> None:
        self._c.set(key, value)  # (a bytes key need not be UTF-8)
        # c10d's set is not answered: a request on this connection returns only after the
        # server applied it, so the junk is in place before the caller's next step (a flexrun
        # client's add raced past it once: the counter read 18 where the put got 2).
        self._c.check([key])

    def get(self, key: str) -> bytes | None:
        return bytes(self._c.get(key)) if self._c.check([key]) else None


class EtcdJunk:
    """etcd's JSON gateway, keys and values as raw bytes (non-UTF-8 keys included)."""

    def __init__(self, host: str, port: int) -> None:
        self._base = f"http://{host}:{port}/v3"

    def _post(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        req = urllib.request.Request(
            self._base + path,
            data=json.dumps(payload).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=10) as resp:  # noqa: S310 (loopback test server)
            return dict(json.loads(resp.read() or b"{}"))

    def keys(self, prefix: bytes = b"") -> list[bytes]:
        end = bytearray(prefix)
        end[-1] += 1
        got = self._post(
            "/kv/range",
            {
                "key": base64.b64encode(prefix).decode(),
                "range_end": base64.b64encode(bytes(end)).decode(),
                "keys_only": True,
                "limit": ETCD_MAX_KEYS,
            },
        )
        return [base64.b64decode(kv["key"]) for kv in got.get("kvs", [])]

    def put(self, key: bytes | str, value: bytes) -> None:
        raw = key.encode() if isinstance(key, str) else key
        self._post(
            "/kv/put",
            {"key": base64.b64encode(raw).decode(), "value": base64.b64encode(value).decode()},
        )


__all__ = ["EtcdJunk", "TcpJunk"]
