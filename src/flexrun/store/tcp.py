"""The embedded store: flexrun's protocol on top of torch's C++ ``TCPStore``.

Owns the encoding of revisions, keep-alive keys and change notification onto a plain
key-value server; it does not run a server of its own making (``TCPStore`` is the
server, hosted by ``flexrun store``, by a ``--standalone`` agent, or by the agent whose
address matches the endpoint).

Encoding. Every stored value is ``b"<revision> <ttl_or_->\\n" + payload``. Revisions come
from one counter key incremented with ``add``. ``compare_and_set`` reads the current raw
value and swaps it with ``TCPStore.compare_set``, which compares whole values, so the
revision inside makes it a compare-and-set on revisions. Deletes write a tombstone
(``"<rev> x\\n"``): ``TCPStore.get`` of a missing key blocks, so keys never disappear
under a reader.

Change notification. After each write attempt the writer sets ``__flexrun/ev/<rev>`` to
the key it wrote (empty if the CAS lost). A watcher that has seen revision ``R`` waits
with ``TCPStore.wait`` for ``ev/<R+1>`` to exist: a blocking server-side wait, no
polling. Old event keys are deleted once they fall ``EVENT_WINDOW`` revisions behind.

Keep-alive keys are judged by each reader: a key written with ``ttl_s`` is absent once
this client has seen its revision unchanged for ``ttl_s`` seconds of its own monotonic
clock, which needs no agreement between hosts' clocks.
"""

from __future__ import annotations

import os
import socket
import threading
from datetime import timedelta
from typing import Any

from flexrun._clock import SYSTEM_CLOCK, Clock
from flexrun.errors import StoreTimeout, StoreUnavailable
from flexrun.store.api import Entry

_REV_KEY = "__flexrun/rev"
_EV_PREFIX = "__flexrun/ev/"
EVENT_WINDOW = 1024
IN_FLIGHT_S = 1.0
_RECENT = 16  # how many of the newest revisions may still be in flight
_TOMBSTONE = b"x"


def _quiet_cpp_logs() -> None:
    # c10d logs a warning for every expired TCPStore.wait; a bounded wait is normal here.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


def _dist() -> Any:
    _quiet_cpp_logs()
    import torch.distributed as dist

    return dist


def probe(host: str, port: int, timeout_s: float, clock: Clock = SYSTEM_CLOCK) -> None:
    """Wait until something accepts TCP connections at ``host:port``.

    Raises:
        StoreUnavailable: nothing accepted within ``timeout_s`` (refused or unreachable).
    """
    deadline = clock.monotonic() + timeout_s
    delay = 0.05
    last: OSError | None = None
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(2.0, timeout_s))):
                return
        except OSError as exc:
            last = exc
        if clock.monotonic() + delay > deadline:
            reason = last.strerror if last is not None and last.strerror else str(last)
            raise StoreUnavailable(
                f"cannot reach the rendezvous store at {host}:{port} ({reason}) after "
                f"{timeout_s:g}s; start one with `flexrun store --host {host} --port {port}` "
                "or check --rdzv-endpoint"
            ) from last
        clock.sleep(delay)
        delay = min(delay * 2, 1.0)


class TcpStoreServer:
    """A ``TCPStore`` server in this process; lives until :meth:`close` or process exit."""

    def __init__(self, host: str = "0.0.0.0", port: int = 0) -> None:
        dist = _dist()
        try:
            self._server = dist.TCPStore(
                host, port, None, True, timedelta(seconds=30), wait_for_workers=False
            )
        except (RuntimeError, OSError) as exc:
            raise StoreUnavailable(
                f"cannot host a store on {host}:{port}: {exc}".splitlines()[0]
            ) from exc
        self.port: int = self._server.port
        self.host = host

    def close(self) -> None:
        # TCPStore has no explicit shutdown; dropping the last reference stops the server.
        self._server = None


def _encode(rev: int, ttl_s: float | None, payload: bytes) -> bytes:
    ttl = "-" if ttl_s is None else repr(float(ttl_s))
    return f"{rev} {ttl}\n".encode() + payload


def _decode(raw: bytes) -> tuple[int, float | None, bytes | None]:
    header, _, payload = raw.partition(b"\n")
    rev_s, _, ttl_s = header.decode().partition(" ")
    if ttl_s == "x":
        return int(rev_s), None, None
    return int(rev_s), (None if ttl_s == "-" else float(ttl_s)), payload


class TcpStore:
    """Client of a ``TCPStore`` server implementing :class:`flexrun.store.Store`."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        connect_timeout_s: float = 30.0,
        op_timeout_s: float = 30.0,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.host = host
        self.port = port
        self._clock = clock
        self._op_timeout = timedelta(seconds=op_timeout_s)
        probe(host, port, connect_timeout_s, clock)
        self._local = threading.local()
        self._local.client = self._connect()
        self._seen_lock = threading.Lock()
        # key -> (revision, monotonic time this client first saw that revision)
        self._seen: dict[str, tuple[int, float]] = {}
        # revision -> when this client first saw it taken but not yet written
        self._in_flight: dict[int, float] = {}
        self._closed = False

    # -- plumbing ---------------------------------------------------------------------
    def _connect(self) -> Any:
        """A new client socket (TCPStore clients are not safe to share across threads)."""
        dist = _dist()
        try:
            return dist.TCPStore(self.host, self.port, None, False, self._op_timeout)
        except (RuntimeError, OSError) as exc:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise StoreUnavailable(
                f"cannot connect to the store at {self.host}:{self.port}: {first}"
            ) from exc

    def _c(self) -> Any:
        if self._closed:
            raise StoreUnavailable("store client is closed")
        client = getattr(self._local, "client", None)
        if client is None:
            # After a lost connection (or in a new thread): reconnect, failing fast if the
            # server is down so callers can back off and retry.
            probe(self.host, self.port, 1.0, self._clock)
            client = self._connect()
            self._local.client = client
        return client

    def _broken(self, exc: RuntimeError) -> StoreUnavailable:
        # Drop this thread's socket: the next call reconnects (e.g. to a restarted store).
        self._local.client = None
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return StoreUnavailable(f"store at {self.host}:{self.port} failed: {first}")

    def _call(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except RuntimeError as exc:  # DistStoreError/DistNetworkError derive from it
            raise self._broken(exc) from exc

    def _next_rev(self) -> int:
        return int(self._call(self._c().add, _REV_KEY, 1))

    def _notify(self, rev: int, key: str) -> None:
        c = self._c()
        self._call(c.set, f"{_EV_PREFIX}{rev}", key)
        if rev > EVENT_WINDOW:
            self._call(c.delete_key, f"{_EV_PREFIX}{rev - EVENT_WINDOW}")

    def _raw(self, key: str) -> bytes | None:
        c = self._c()
        if not self._call(c.check, [key]):
            return None
        return bytes(self._call(c.get, key))

    def _live(self, key: str, raw: bytes | None) -> Entry | None:
        if raw is None:
            return None
        rev, ttl, payload = _decode(raw)
        if payload is None:
            return None
        if ttl is not None:
            now = self._clock.monotonic()
            with self._seen_lock:
                seen = self._seen.get(key)
                if seen is None or seen[0] != rev:
                    self._seen[key] = (rev, now)
                elif now - seen[1] >= ttl:
                    return None
        return Entry(payload, rev)

    # -- protocol ---------------------------------------------------------------------
    def get(self, key: str) -> Entry | None:
        return self._live(key, self._raw(key))

    def get_prefix(self, prefix: str) -> dict[str, Entry]:
        c = self._c()
        keys = sorted(
            k
            for k in self._call(c.list_keys)
            if k.startswith(prefix) and not k.startswith("__flexrun/")
        )
        if not keys:
            return {}
        raws = self._call(c.multi_get, keys)
        out = {}
        for key, raw in zip(keys, raws, strict=True):
            entry = self._live(key, bytes(raw))
            if entry is not None:
                out[key] = entry
        return out

    def put(self, key: str, value: bytes, *, ttl_s: float | None = None) -> int:
        rev = self._next_rev()
        self._call(self._c().set, key, _encode(rev, ttl_s, bytes(value)))
        self._notify(rev, key)
        return rev

    def compare_and_set(
        self, key: str, value: bytes, *, expected_revision: int
    ) -> tuple[bool, Entry | None]:
        current_raw = self._raw(key)
        current = self._live(key, current_raw)
        current_rev = current.revision if current is not None else 0
        if current_rev != expected_revision:
            return False, current
        rev = self._next_rev()
        new_raw = _encode(rev, None, bytes(value))
        ok = False
        try:
            got = bytes(self._call(self._c().compare_set, key, current_raw or b"", new_raw))
            ok = got == new_raw
        finally:
            self._notify(rev, key if ok else "")
        if ok:
            return True, Entry(bytes(value), rev)
        return False, self.get(key)

    def delete(self, key: str) -> None:
        raw = self._raw(key)
        if raw is None or _decode(raw)[2] is None:
            return
        rev = self._next_rev()
        self._call(self._c().set, key, f"{rev} x\n".encode())
        self._notify(rev, key)

    def revision(self) -> int:
        """The highest revision below which every write has landed.

        The counter may be ahead of the data: a writer takes its revision first and its
        write lands a moment later. State read "at" the raw counter could miss that write,
        and a watch from there would skip it; so report the revision just below the oldest
        write still in flight (one abandoned for IN_FLIGHT_S by a dead writer is ignored).
        """
        c = self._c()
        current = int(self._call(c.add, _REV_KEY, 0))
        lo = max(1, current - _RECENT + 1)
        names = [f"{_EV_PREFIX}{r}" for r in range(lo, current + 1)]
        if not names or self._call(c.check, names):
            return current
        now = self._clock.monotonic()
        for r, name in zip(range(lo, current + 1), names, strict=True):
            if self._call(c.check, [name]):
                continue
            with self._seen_lock:
                first = self._in_flight.setdefault(r, now)
                if len(self._in_flight) > 4 * _RECENT:
                    for old in sorted(self._in_flight)[: 2 * _RECENT]:
                        del self._in_flight[old]
            if now - first < IN_FLIGHT_S:
                return r - 1
        return current

    def wait_for_change(
        self, prefix: str, since_revision: int, timeout_s: float
    ) -> tuple[bool, int]:
        deadline = self._clock.monotonic() + timeout_s
        seen = since_revision
        c = self._c()
        # A revision is taken (``add``) before its write lands and its event key is set:
        # until then it is in flight, and skipping it would miss that write. A writer that
        # died in between never sets it: after IN_FLIGHT_S it counts as abandoned.
        in_flight: dict[int, float] = {}
        while True:
            current = self.revision()
            if current - seen > EVENT_WINDOW:
                return True, current  # too far behind to tell: report a change
            for r in range(seen + 1, current + 1):
                name = f"{_EV_PREFIX}{r}"
                if self._call(c.check, [name]):
                    key = bytes(self._call(c.get, name)).decode()
                    if key and key.startswith(prefix):
                        return True, current
                    seen = r
                    continue
                first = in_flight.setdefault(r, self._clock.monotonic())
                if self._clock.monotonic() - first < IN_FLIGHT_S:
                    break
                seen = r  # abandoned by a writer that died between add and notify
            remaining = deadline - self._clock.monotonic()
            if remaining <= 0:
                return False, seen
            step = min(remaining, 5.0 if seen >= current else IN_FLIGHT_S)
            try:
                c.wait([f"{_EV_PREFIX}{seen + 1}"], timedelta(seconds=step))
            except RuntimeError as exc:
                if type(exc).__name__ == "DistNetworkError" or "timeout" not in str(exc).lower():
                    raise self._broken(exc) from exc

    def close(self) -> None:
        self._closed = True


__all__ = ["TcpStore", "TcpStoreServer", "probe", "StoreTimeout"]
