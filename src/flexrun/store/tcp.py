"""The embedded store: flexrun's protocol on top of torch's C++ ``TCPStore``.

Owns the encoding of revisions, keep-alive keys and change notification onto a plain
key-value server; it does not run a server of its own making (``TCPStore`` is the
server, hosted by ``flexrun store``, by a ``--standalone`` agent, or by the agent whose
address matches the endpoint).

Encoding. Every stored value is ``b"<revision> <ttl_or_->\\n" + payload``. Revisions come
from one counter key incremented with ``add``. ``compare_and_set`` reads the current raw
value and swaps it with ``TCPStore.compare_set``, which compares whole values, so the
revision inside makes it a compare-and-set on revisions; the raw value of the last read is
kept, so a compare-and-set after a read is one request. Deletes write a tombstone
(``"<rev> x\\n"``): ``TCPStore.get`` of a missing key blocks, so keys never disappear
under a reader; only :meth:`TcpStore.delete_prefix`, for keys nobody reads any more,
removes keys from the server (without change events).

Change notification. After each write attempt the writer sets ``__flexrun/ev/<rev>`` to
the key it wrote and a digest of the value without its revision (empty if the CAS lost):
the event log, read in batches by watchers to learn which keys changed (and, from the
digest, which were rewritten unchanged, as keep-alives are: :mod:`flexrun.store.tcp_reads`).
Old event keys are deleted once they fall ``EVENT_WINDOW`` revisions behind. A write of
``a/b/c`` then rings the *channel* of each directory above the key (``a/`` and ``a/b/``)
that someone watches: a per-directory counter
``__flexrun/chn/<dir>`` (``add``) and a key ``__flexrun/ch/<dir><n>`` that the write
creates. Watched directories are listed in one small key, ``__flexrun/watched``, which a
watcher extends (compare-and-set) the first time it watches a directory and every writer
reads, so a write rings only directories somebody waits on (a keep-alive under ``hb/``
rings nothing when only ``s/`` is watched). A watcher of prefix ``p`` registers ``p``'s
directory, reads its counter ``n``, scans the event log since its revision, and if
nothing under ``p`` changed waits with ``TCPStore.wait`` for ``ch/<dir><n+1>`` to exist:
a blocking server-side wait, no polling, that writes elsewhere (another job, the
keep-alives while the watcher watches ``s/``) do not wake. A writer logs its event, then
reads the list, then rings: one that read the list before the watcher registered, or
rang before the watcher read the counter, logged its event before the watcher scans the
log, which finds it. A prefix with no ``/`` waits on the event log itself. After the first
wait, a watcher needs no log scan at all (wait tokens, :mod:`flexrun.store.tcp_watch`).

Anyone who reaches the server can write bytes that are not this encoding, under any key
(flexrun's own counters and change log included): what a reader makes of them, and the
repair of a counter, is :mod:`flexrun.store.tcp_junk`; none of them raises out of a read.

Keep-alive keys are judged by each reader: a key written with ``ttl_s`` is absent once
this client has seen its revision unchanged for ``ttl_s`` seconds of its own monotonic
clock, which needs no agreement between hosts' clocks.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from flexrun._clock import SYSTEM_CLOCK, Clock
from flexrun.errors import StoreTimeout, StoreUnavailable
from flexrun.store.api import Entry
from flexrun.store.tcp_junk import Junk, decode
from flexrun.store.tcp_reads import PrefixReads
from flexrun.store.tcp_server import TcpStoreServer, dist, probe
from flexrun.store.tcp_watch import (
    _CH_COUNT,
    _CH_PREFIX,
    _EV_PREFIX,
    _INTERNAL,
    _REV_KEY,
    BATCH,
    EVENT_WINDOW,
    ChangeLog,
    dir_of,
    event,
)

_WATCHED_KEY = "__flexrun/watched"
CHANNEL_WINDOW = 256  # ring keys kept per directory (a watcher waits for the next one)
RAW_CACHE = 4096  # raw values kept for a compare-and-set without a read
CONNECT_S = 2.0
"""How long a reconnect's ``TCPStore`` connect may try (torch tries twice, so about 2x this
plus its back-off; a client's first connection has what is left of its connect timeout, at
least this: a loaded server's full accept queue drops SYNs for longer). A probe found the
server a moment before; one that died meanwhile must not hold the calling thread for the
operation timeout: torch retries a refused connect for the whole timeout it is given (30 s
held a static job's survivor that long after its store died)."""
_TOMBSTONE = b"x"
_dir_of = dir_of


def _encode(rev: int, ttl_s: float | None, payload: bytes) -> bytes:
    ttl = "-" if ttl_s is None else repr(float(ttl_s))
    return f"{rev} {ttl}\n".encode() + payload


def _dirs(key: str) -> list[str]:
    """The directories above ``key`` (``a/b/c`` -> ``a/``, ``a/b/``): the channels it rings."""
    return [key[: i + 1] for i, ch in enumerate(key) if ch == "/"]


_decode = decode


class TcpStore:
    """Client of a ``TCPStore`` server implementing :class:`flexrun.store.Store`."""

    judges_ttl_locally = True
    """Keep-alive TTLs are judged by each reader's clock (the rendezvous needs to know:
    a key seen for the first time looks fresh for a full TTL, even a dead node's)."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        connect_timeout_s: float = 30.0,
        op_timeout_s: float = 30.0,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.host, self.port = host, port
        self._clock = clock
        self._op_timeout = timedelta(seconds=op_timeout_s)
        deadline = clock.monotonic() + connect_timeout_s
        probe(host, port, connect_timeout_s, clock)
        self._local = threading.local()
        self._local.client = self._connect(max(CONNECT_S, deadline - clock.monotonic()))
        self._seen_lock = threading.Lock()
        self._seen: dict[str, tuple[int, float, float]] = {}  # key -> (rev, first seen, ttl)
        self._raw_cache: OrderedDict[str, bytes] = OrderedDict()  # key -> last raw value seen
        self._junk = Junk(self)  # what stands for bytes that are not this encoding
        self.rejects = self._junk.rejects  # (what it ignores: see report_to)
        self._log = ChangeLog(self)  # revisions, the event log, watches
        self._reads = PrefixReads(self)  # get_prefix
        self._closed = False

    # -- plumbing ---------------------------------------------------------------------
    def _connect(self, timeout_s: float = CONNECT_S) -> Any:
        """A new client socket (TCPStore clients are not safe to share across threads)."""
        try:
            client = dist().TCPStore(
                self.host, self.port, None, False, timedelta(seconds=timeout_s)
            )
            client.set_timeout(self._op_timeout)
            return client
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

    def _next_rev(self, count: int = 1) -> int:
        return self._add(_REV_KEY, count)

    def _add(self, key: str, amount: int) -> int:
        """``TCPStore.add`` of one of the counters (the revision, a ring count). The server
        drops a client whose ``add`` meets a value that is not a number (a stranger's
        write): such a counter is reset (:meth:`_repair`) and the ``add`` tried once more."""
        c = self._c()  # (an unreachable store raises here: nothing to repair)
        try:
            return int(self._call(c.add, key, amount))
        except StoreUnavailable:
            if self._closed or not self._junk.repair(key):
                raise
        return int(self._call(self._c().add, key, amount))

    def _prune(self, revs: range) -> None:
        """Drop the event keys that ``revs`` push out of the window."""
        c = self._c()
        for rev in revs:
            if rev > EVENT_WINDOW:
                self._call(c.delete_key, f"{_EV_PREFIX}{rev - EVENT_WINDOW}")

    def _ring(self, keys: list[str]) -> None:
        """Ring the channels of the watched directories above ``keys`` (once each), after
        their events are logged."""
        watched = set(self._watched().split(b"\n"))
        dirs = sorted({d for key in keys for d in _dirs(key) if d.encode() in watched})
        if not dirs:
            return
        c = self._c()
        rings = [self._add(f"{_CH_COUNT}{d}", 1) for d in dirs]
        self._call(
            c.multi_set,
            [f"{_CH_PREFIX}{d}{n}" for d, n in zip(dirs, rings, strict=True)],
            [b""] * len(dirs),
        )
        for d, n in zip(dirs, rings, strict=True):
            if n > CHANNEL_WINDOW:
                self._call(c.delete_key, f"{_CH_PREFIX}{d}{n - CHANNEL_WINDOW}")

    def _notify(
        self, rev: int, key: str, *, logged: bool = False, raw: bytes | None = None
    ) -> None:
        """Log the write of ``raw`` to ``key`` at ``rev`` (unless ``logged``), then ring its
        channels."""
        if not logged:
            self._call(self._c().set, f"{_EV_PREFIX}{rev}", event(key, raw))
        self._prune(range(rev, rev + 1))
        if key:
            self._ring([key])

    def _watched(self) -> bytes:
        """The list of watched directories (one request; creates it empty if absent)."""
        return bytes(self._call(self._c().compare_set, _WATCHED_KEY, b"", b""))

    def _watch(self, directory: str) -> None:
        """Add ``directory`` to the watched list unless it is there (before any read)."""
        if self._log.watching(directory):
            return
        name = directory.encode()
        current = self._watched()
        for _ in range(1000):  # each lost race means another watcher registered
            if name in current.split(b"\n"):
                break
            new = current + b"\n" + name if current else name
            got = bytes(self._call(self._c().compare_set, _WATCHED_KEY, current, new))
            if got == new:
                break
            current = got
        else:
            raise StoreUnavailable("could not register a watch (the watched list keeps changing)")
        self._log.watched(directory)

    def _remember(self, key: str, raw: bytes | None) -> None:
        with self._seen_lock:
            if raw is None:
                self._raw_cache.pop(key, None)
                return
            self._raw_cache[key] = raw
            self._raw_cache.move_to_end(key)
            if len(self._raw_cache) > RAW_CACHE:
                self._raw_cache.popitem(last=False)

    def _raw(self, key: str) -> bytes | None:
        c = self._c()
        raw = bytes(self._call(c.get, key)) if self._call(c.check, [key]) else None
        self._remember(key, raw)
        return raw

    def _live(self, key: str, raw: bytes | None) -> Entry | None:
        decoded = self._junk.judged(key, raw)
        if decoded is None:
            return None
        rev, ttl, payload = decoded
        if payload is None:
            return None
        if ttl is not None:
            now = self._clock.monotonic()
            with self._seen_lock:
                seen = self._seen.get(key)
                if seen is None or seen[0] != rev:
                    self._seen[key] = (rev, now, ttl)
                elif now - seen[1] >= ttl:
                    return None
        return Entry(payload, rev)

    def expires_at(self, key: str) -> float | None:
        """When (monotonic) this client will judge the keep-alive ``key`` expired unless it
        reads a newer write first; None: it has read no keep-alive of that name."""
        seen = self._seen.get(key)  # (one tuple, replaced whole under the lock)
        return None if seen is None else seen[1] + seen[2]

    # -- protocol ---------------------------------------------------------------------
    def get(self, key: str) -> Entry | None:
        return self._live(key, self._raw(key))

    def get_prefix(self, prefix: str) -> dict[str, Entry]:
        """Every live key under ``prefix``; a repeated call fetches only what was written
        since the last one (:mod:`flexrun.store.tcp_reads`)."""
        raws = self._reads.read(prefix)
        out = {}
        for key in sorted(raws):
            entry = self._live(key, raws[key])
            if entry is not None:
                out[key] = entry
        return out

    def put(self, key: str, value: bytes, *, ttl_s: float | None = None) -> int:
        rev = self._next_rev()
        raw = _encode(rev, ttl_s, bytes(value))
        # One request sets the value and logs the event (the server applies them in order).
        self._call(self._c().multi_set, [key, f"{_EV_PREFIX}{rev}"], [raw, event(key, raw)])
        self._remember(key, raw)
        self._notify(rev, key, logged=True)
        return rev

    def put_many(self, items: Mapping[str, bytes]) -> int:
        """One revision per key, values and events in requests of BATCH keys, one ring per
        watched directory."""
        keys = list(items)
        if not keys:
            return 0
        last = self._next_rev(len(keys))
        first = last - len(keys) + 1
        c = self._c()
        for i in range(0, len(keys), BATCH):
            names: list[str] = []
            values: list[bytes] = []
            for j, key in enumerate(keys[i : i + BATCH], start=first + i):
                raw = _encode(j, None, bytes(items[key]))
                names += [key, f"{_EV_PREFIX}{j}"]
                values += [raw, event(key, raw)]
            self._call(c.multi_set, names, values)
        self._prune(range(first, last + 1))
        self._ring(keys)
        return last

    def compare_and_set(
        self, key: str, value: bytes, *, expected_revision: int
    ) -> tuple[bool, Entry | None]:
        """One request after a read of the key by this client (its raw value is kept);
        otherwise a read first. A loss returns ``(False, None)``."""
        with self._seen_lock:
            cached = self._raw_cache.get(key)
        current_raw = cached
        if cached is None or self._rev_of(key, cached) != expected_revision:
            current_raw = self._raw(key)
            if self._rev_of(key, current_raw) != expected_revision:
                return False, None
        rev = self._next_rev()
        new_raw = _encode(rev, None, bytes(value))
        ok = False
        try:
            got = bytes(self._call(self._c().compare_set, key, current_raw or b"", new_raw))
            ok = got == new_raw
            # (A loss forgets the kept value: the next attempt reads the key first.)
            self._remember(key, new_raw if ok else None)
        finally:
            self._notify(rev, key if ok else "", raw=new_raw)
        return (True, Entry(bytes(value), rev)) if ok else (False, None)

    def _rev_of(self, key: str, raw: bytes | None) -> int:
        """The revision a raw value under ``key`` stands for (0: absent or a tombstone;
        junk stands for the last value read under the key: a compare-and-set expecting
        that one's revision replaces the junk)."""
        decoded = self._junk.judged(key, raw)
        return decoded[0] if decoded is not None and decoded[2] is not None else 0

    def delete(self, key: str) -> None:
        raw = self._raw(key)
        if raw is None or (_decode(raw) or (0, None, b""))[2] is None:
            return
        rev = self._next_rev()
        tomb = f"{rev} x\n".encode()
        self._call(self._c().multi_set, [key, f"{_EV_PREFIX}{rev}"], [tomb, event(key, tomb)])
        self._remember(key, tomb)
        self._notify(rev, key, logged=True)

    def delete_prefix(self, prefix: str) -> None:
        """Remove every key under ``prefix`` from the server, without tombstones or change
        events (the keys would otherwise stay on the server for ever): only for keys that
        nobody reads or watches any more; this client forgets its cached reads of them."""
        if not prefix:
            raise ValueError("delete_prefix needs a non-empty prefix")
        c = self._c()
        for key in self._junk.list_keys():
            if key.startswith(prefix) and not key.startswith(_INTERNAL):
                self._call(c.delete_key, key)
        self._reads.forget(prefix)
        with self._seen_lock:
            for key in [k for k in self._raw_cache if k.startswith(prefix)]:
                del self._raw_cache[key]
        self._junk.forget(prefix)

    def revision(self) -> int:
        """The highest revision below which every write has landed (see
        :meth:`flexrun.store.tcp_watch.ChangeLog.revision`)."""
        return self._log.revision()

    def wait_for_change(
        self, prefix: str, since_revision: int, timeout_s: float
    ) -> tuple[bool, int]:
        return self._log.wait_for_change(prefix, since_revision, timeout_s)

    def _fetch_events(self, oldest: int, names: list[str]) -> list[Any] | None:
        return self._log._fetch_events(oldest, names)

    def close(self) -> None:
        self._closed = True


def delete_all_but(client: TcpStore, keep: str) -> int:
    """Remove from ``client``'s server every key but those under ``keep`` and the protocol's
    own (counters, change log, channels): a static job's workers' keys of an earlier round,
    which share the server with the job's records (torch's workers put no per-round prefix
    on their keys, and must find none of a dead world's). Only while no client of those
    keys runs. Returns how many were removed."""
    if not keep:
        raise ValueError("delete_all_but needs a non-empty prefix to keep")
    c = client._c()
    gone = 0
    for key in client._junk.list_keys():
        if not key.startswith((keep, _INTERNAL)):
            client._call(c.delete_key, key)
            gone += 1
    return gone


__all__ = ["EVENT_WINDOW", "delete_all_but", "StoreTimeout", "TcpStore", "TcpStoreServer", "probe"]
