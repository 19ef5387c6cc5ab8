"""What a tcp store client makes of bytes that are not its encoding (a stranger's write).

Owns the decoding of a raw value (:func:`decode`: None for junk), what junk under a key
stands for (the last value of the encoding this client read there: junk counts as no
write at all), the repair of a counter the server cannot ``add`` to, and the rate-limited
report of each (``store_record_rejected``). Anyone who reaches a ``TCPStore`` can write any
bytes under any key; none of them may raise out of a reader. The encoding itself is
described in :mod:`flexrun.store.tcp`.
"""

from __future__ import annotations

import socket
import struct
from typing import TYPE_CHECKING

from flexrun.errors import StoreUnavailable
from flexrun.store.rejects import Rejects
from flexrun.store.tcp_watch import _CH_COUNT, _CH_PREFIX, _EV_PREFIX, _REV_KEY

if TYPE_CHECKING:
    from flexrun.store.tcp import TcpStore

REPAIR_GAP = 16  # revisions a reset counter skips (writes in flight as it was overwritten)

MAX_REVISION = (1 << 63) - 1  # TCPStore's counters are int64


def decode(raw: bytes) -> tuple[int, float | None, bytes | None] | None:
    """``(revision, ttl, payload)`` of a raw value (payload None: a tombstone); None for
    bytes that are not this encoding (anyone who reaches the server can write any)."""
    header, sep, payload = raw.partition(b"\n")
    rev_s, _, ttl_s = header.partition(b" ")
    if not sep or not rev_s.isdigit() or len(rev_s) > 19 or not rev_s.isascii():
        return None
    rev = int(rev_s)
    if not 0 < rev <= MAX_REVISION:
        return None
    if ttl_s == b"x":
        return (rev, None, None) if not payload else None
    if ttl_s == b"-":
        return rev, None, payload
    try:
        ttl = float(ttl_s.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        return None
    return (rev, ttl, payload) if 0 < ttl < float("inf") else None


def is_counter(raw: bytes) -> bool:
    """Whether the server can ``add`` to ``raw`` (it drops the client otherwise)."""
    text = raw.strip()
    digits = text[1:] if text[:1] in (b"-", b"+") else text
    return digits.isdigit() and digits.isascii() and -MAX_REVISION - 1 <= int(text) <= MAX_REVISION


_VALIDATE, _LIST_KEYS, _MAGIC = 0, 17, 0x3C85F7CE  # TCPStore's wire protocol (torch 2.13)
_MAX_KEYS, _MAX_KEY = 1 << 24, 1 << 20


def raw_keys(host: str, port: int, timeout_s: float) -> list[bytes]:
    """Every key on the server as bytes (``TCPStore.list_keys`` raises on one that is not
    UTF-8, which a bare client can write): one request on a connection of its own.

    Raises:
        StoreUnavailable: the server cannot be reached or answers out of protocol.
    """
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as conn:
            conn.sendall(struct.pack("<BIB", _VALIDATE, _MAGIC, _LIST_KEYS))
            stream = conn.makefile("rb")

            def read(n: int) -> bytes:
                data = stream.read(n)
                if len(data) != n:
                    raise StoreUnavailable(f"store at {host}:{port} closed a key listing")
                return bytes(data)

            (count,) = struct.unpack("<q", read(8))
            if not 0 <= count <= _MAX_KEYS:
                raise StoreUnavailable(f"store at {host}:{port}: a listing of {count} keys")
            keys = []
            for _ in range(count):
                (size,) = struct.unpack("<Q", read(8))
                if size > _MAX_KEY:
                    raise StoreUnavailable(f"store at {host}:{port}: a key of {size} bytes")
                key = read(size)
                keys.append(key[1:] if key.startswith(b"/") else key)  # (the client's prefix)
            return keys
    except OSError as exc:
        raise StoreUnavailable(f"cannot list the keys of the store at {host}:{port}: {exc}") from exc


class Junk:
    """One client's view of the junk under its keys."""

    def __init__(self, client: TcpStore) -> None:
        self._client = client
        self._lock = client._seen_lock
        # key -> the last value of this encoding read under it, which stands for junk
        # written over it since
        self._good: dict[str, bytes] = {}
        self.rejects = Rejects(
            "ignored a store value that is not a flexrun record", clock=client._clock
        )

    def list_keys(self) -> list[str]:
        """``TCPStore.list_keys``; where a key is not UTF-8 (no flexrun client writes one),
        the keys that are, from a listing of its own, and the others deleted (reported)."""
        client = self._client
        c = client._c()
        try:
            return list(client._call(c.list_keys))
        except UnicodeDecodeError:
            pass
        keys = []
        for raw in raw_keys(client.host, client.port, client._op_timeout.total_seconds()):
            try:
                keys.append(raw.decode())
            except UnicodeDecodeError:
                self.rejects.report(repr(raw[:64]), "key is not UTF-8: deleted")
                client._call(c.delete_key, raw)
        return keys

    def forget(self, prefix: str) -> None:
        """Keys under ``prefix`` were removed from the server."""
        with self._lock:
            for key in [k for k in self._good if k.startswith(prefix)]:
                del self._good[key]

    def judged(self, key: str, raw: bytes | None) -> tuple[int, float | None, bytes | None] | None:
        """What ``raw`` under ``key`` stands for: itself, or when it is junk (reported, at a
        bounded rate), the last value of this encoding read under the key (None: none, the
        key counts as absent): junk counts as no write at all."""
        if raw is None:
            return None
        decoded = decode(raw)
        with self._lock:
            if decoded is not None:
                if decoded[2] is None:
                    self._good.pop(key, None)
                else:
                    self._good[key] = raw
                return decoded
            good = self._good.get(key)
        self.rejects.report(key, "not a flexrun record")
        return None if good is None else decode(good)

    def repair(self, key: str) -> bool:
        """Replace a counter the server cannot add to; False if it can (the ``add`` failed
        for another reason). The revision counter restarts above the newest revision in the
        event log (the revisions skipped are logged as empty events: nothing to wait for);
        a ring count at the newest ring key of its directory."""
        c = self._client._c()
        if not self._client._call(c.check, [key]):
            return False
        raw = bytes(self._client._call(c.get, key))
        if is_counter(raw):
            return False
        if key == _REV_KEY:
            listed = self.list_keys()
            logged = [k[len(_EV_PREFIX) :] for k in listed if k.startswith(_EV_PREFIX)]
            newest = max((int(r) for r in logged if r.isdigit() and r.isascii()), default=0)
            value = newest + REPAIR_GAP
            for rev in range(newest + 1, value + 1):  # (an event written since stays)
                self._client._call(c.compare_set, f"{_EV_PREFIX}{rev}", b"", b"")
        else:
            directory = key[len(_CH_COUNT) :]
            names = [
                k for k in self.list_keys() if k.startswith(_CH_PREFIX + directory)
            ]
            tails = (k[len(_CH_PREFIX) + len(directory) :] for k in names)
            value = max((int(t) for t in tails if t.isdigit() and t.isascii()), default=0)
        got = bytes(self._client._call(c.compare_set, key, raw, str(value).encode()))
        if is_counter(got):
            self.rejects.report(key, f"counter {raw[:32]!r} is not a number: reset to {value}")
        return is_counter(got)


__all__ = ["Junk", "decode", "is_counter", "raw_keys"]
