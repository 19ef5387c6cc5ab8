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
the key it wrote (empty if the CAS lost): the event log, read in batches by watchers to
learn which keys changed. Old event keys are deleted once they fall ``EVENT_WINDOW``
revisions behind. A write of ``a/b/c`` then rings the *channel* of each directory above
the key (``a/`` and ``a/b/``) that someone watches: a per-directory counter
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
log, which finds it. A prefix with no ``/`` waits on the event log itself.

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
_CH_COUNT = "__flexrun/chn/"
_EPOCH_KEY = "__flexrun/epoch"
_WATCHED_KEY = "__flexrun/watched"
_CH_PREFIX = "__flexrun/ch/"
EVENT_WINDOW = 1024
CHANNEL_WINDOW = 256  # ring keys kept per directory (a watcher waits for the next one)
SNAPSHOTS = 16  # prefixes whose last get_prefix is kept for an incremental re-read
WAIT_STEP_S = 5.0  # longest single server-side wait (bounds a ring lost by a dead writer)
IN_FLIGHT_S = 1.0
_RECENT = 256  # how many of the newest revisions may still be in flight
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


def _dirs(key: str) -> list[str]:
    """The directories above ``key`` (``a/b/c`` -> ``a/``, ``a/b/``): the channels it rings."""
    return [key[: i + 1] for i, ch in enumerate(key) if ch == "/"]


def _dir_of(prefix: str) -> str:
    """The directory whose channel rings for every key under ``prefix`` ("" for none)."""
    return prefix[: prefix.rfind("/") + 1]


def _decode(raw: bytes) -> tuple[int, float | None, bytes | None]:
    header, _, payload = raw.partition(b"\n")
    rev_s, _, ttl_s = header.decode().partition(" ")
    if ttl_s == "x":
        return int(rev_s), None, None
    return int(rev_s), (None if ttl_s == "-" else float(ttl_s)), payload


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
        # prefix -> (revision, key -> raw value): the last get_prefix, brought up to date
        # from the event log by the next one (only keys written since are fetched)
        # (the store's epoch is in it: a restarted server has lost the keys it names)
        self._snapshots: dict[str, tuple[bytes, int, dict[str, bytes]]] = {}
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

    def _notify(self, rev: int, key: str, *, logged: bool = False) -> None:
        """Log the write of ``key`` at ``rev`` (unless ``logged``), then ring its channels."""
        c = self._c()
        if not logged:
            self._call(c.set, f"{_EV_PREFIX}{rev}", key)
        if rev > EVENT_WINDOW:
            self._call(c.delete_key, f"{_EV_PREFIX}{rev - EVENT_WINDOW}")
        if not key:
            return
        # Only after the event is logged: read which directories are watched, ring those.
        watched = set(self._watched().split(b"\n"))
        dirs = [d for d in _dirs(key) if d.encode() in watched]
        if not dirs:
            return
        rings = [int(self._call(c.add, f"{_CH_COUNT}{d}", 1)) for d in dirs]
        self._call(
            c.multi_set,
            [f"{_CH_PREFIX}{d}{n}" for d, n in zip(dirs, rings, strict=True)],
            [b""] * len(dirs),
        )
        for d, n in zip(dirs, rings, strict=True):
            if n > CHANNEL_WINDOW:
                self._call(c.delete_key, f"{_CH_PREFIX}{d}{n - CHANNEL_WINDOW}")

    def _watched(self) -> bytes:
        """The list of watched directories (one request; creates it empty if absent)."""
        return bytes(self._call(self._c().compare_set, _WATCHED_KEY, b"", b""))

    def _watch(self, directory: str) -> None:
        """Add ``directory`` to the watched list unless it is there (before any read)."""
        name = directory.encode()
        current = self._watched()
        for _ in range(1000):  # each lost race means another watcher registered
            if name in current.split(b"\n"):
                return
            new = current + b"\n" + name if current else name
            got = bytes(self._call(self._c().compare_set, _WATCHED_KEY, current, new))
            if got == new:
                return
            current = got
        raise StoreUnavailable("could not register a watch (the watched list keeps changing)")

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
        """Every live key under ``prefix``; a repeated call fetches only what was written
        since the last one (the event log names those keys), not every key again."""
        c = self._c()
        at = self.revision()  # every write up to here has landed and is logged
        with self._seen_lock:
            snap = self._snapshots.get(prefix)
        raws: dict[str, bytes] | None = None
        epoch = b""
        if snap is not None and 0 <= at - snap[1] <= EVENT_WINDOW // 2:
            epoch = snap[0]
            raws = self._catch_up(prefix, snap, at)
        if raws is None:
            # This server's epoch: created by the first reader, gone if the server restarts.
            epoch = bytes(self._call(c.compare_set, _EPOCH_KEY, b"", os.urandom(8).hex().encode()))
            keys = sorted(
                k
                for k in self._call(c.list_keys)
                if k.startswith(prefix) and not k.startswith("__flexrun/")
            )
            values = self._call(c.multi_get, keys) if keys else []
            raws = {k: bytes(v) for k, v in zip(keys, values, strict=True)}
        with self._seen_lock:
            old = self._snapshots.get(prefix)
            if old is None or old[1] <= at:
                self._snapshots[prefix] = (epoch, at, raws)
                if len(self._snapshots) > SNAPSHOTS:
                    del self._snapshots[next(iter(self._snapshots))]
        out = {}
        for key in sorted(raws):
            entry = self._live(key, raws[key])
            if entry is not None:
                out[key] = entry
        return out

    def _catch_up(
        self, prefix: str, snap: tuple[bytes, int, dict[str, bytes]], at: int
    ) -> dict[str, bytes] | None:
        """A snapshot's keys updated to revision ``at``; None: the log cannot tell."""
        c = self._c()
        epoch, since, raws = snap
        names = [_EPOCH_KEY] + [f"{_EV_PREFIX}{r}" for r in range(since + 1, at + 1)]
        if not self._call(c.check, names):
            return None  # a restarted server, a revision abandoned by a dead writer
        got = self._fetch_events(since + 1, names)
        if got is None or bytes(got[0]) != epoch:
            return None  # a restarted server that has been written to since
        logged = {bytes(k).decode() for k in got[1:]}
        changed = sorted(
            k for k in logged if k and k.startswith(prefix) and not k.startswith("__flexrun/")
        )
        if not changed:
            return raws
        out = dict(raws)
        for key, raw in zip(changed, self._call(c.multi_get, changed), strict=True):
            out[key] = bytes(raw)
        return out

    def _fetch_events(self, oldest: int, names: list[str]) -> list[Any] | None:
        """``multi_get`` of keys just checked to exist, event keys from revision ``oldest``
        on; None if writers may prune the oldest meanwhile (``TCPStore.get`` of a missing
        key blocks until the op timeout: seen with 1024 agents, whose burst of writes pushed
        the event window past a reader between its check and its read)."""
        c = self._c()
        if int(self._call(c.add, _REV_KEY, 0)) - oldest >= EVENT_WINDOW // 2:
            return None
        return list(self._call(c.multi_get, names))

    def put(self, key: str, value: bytes, *, ttl_s: float | None = None) -> int:
        rev = self._next_rev()
        # One request sets the value and logs the event (the server applies them in order).
        self._call(
            self._c().multi_set,
            [key, f"{_EV_PREFIX}{rev}"],
            [_encode(rev, ttl_s, bytes(value)), key.encode()],
        )
        self._notify(rev, key, logged=True)
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
        self._call(
            self._c().multi_set, [key, f"{_EV_PREFIX}{rev}"], [f"{rev} x\n".encode(), key.encode()]
        )
        self._notify(rev, key, logged=True)

    def revision(self) -> int:
        """The highest revision below which every write has landed.

        The counter may be ahead of the data: a writer takes its revision first and its
        write lands a moment later. State read "at" the raw counter could miss that write,
        and a watch from there would skip it; so report the revision just below the oldest
        write still in flight (one abandoned for IN_FLIGHT_S by a dead writer is ignored).
        """
        current = int(self._call(self._c().add, _REV_KEY, 0))
        return self._logged_up_to(max(1, current - _RECENT + 1), current, self._in_flight)

    def _logged_up_to(self, lo: int, hi: int, in_flight: dict[int, float]) -> int:
        """The highest ``r <= hi`` such that every revision in ``lo..r`` is logged (or
        abandoned: taken but not logged for IN_FLIGHT_S); ``lo - 1`` if none is."""
        now = self._clock.monotonic()
        while lo <= hi:
            r = self._first_unlogged(lo, hi)
            if r is None:
                return hi
            with self._seen_lock:
                first = in_flight.setdefault(r, now)
                if len(in_flight) > 4 * _RECENT:
                    for old in sorted(in_flight)[: 2 * _RECENT]:
                        del in_flight[old]
            if now - first < IN_FLIGHT_S:
                return r - 1
            lo = r + 1  # abandoned by a writer that died between taking and logging it
        return hi

    def _first_unlogged(self, lo: int, hi: int) -> int | None:
        """The oldest revision in ``lo..hi`` not in the event log, None if all are: one
        request when all are logged, a bisection (log2 of the range) otherwise."""
        c = self._c()

        def logged(a: int, b: int) -> bool:
            return bool(self._call(c.check, [f"{_EV_PREFIX}{r}" for r in range(a, b + 1)]))

        if hi < lo or logged(lo, hi):
            return None
        a, b = lo, hi  # the first unlogged lies in a..b
        while a < b:
            mid = (a + b) // 2
            if logged(a, mid):
                a = mid + 1
            else:
                b = mid
        return a

    def wait_for_change(
        self, prefix: str, since_revision: int, timeout_s: float
    ) -> tuple[bool, int]:
        deadline = self._clock.monotonic() + timeout_s
        seen = since_revision
        c = self._c()
        channel = _dir_of(prefix)
        if channel:
            self._watch(channel)
        in_flight: dict[int, float] = {}
        last_ring = -1
        while True:
            # Read the ring count *before* the log: a write logged after this read rings
            # a number above it, one logged before is found in the log.
            ring = int(self._call(c.add, f"{_CH_COUNT}{channel}", 0)) if channel else 0
            current = int(self._call(c.add, _REV_KEY, 0))
            if current - seen > EVENT_WINDOW:
                return True, self.revision()  # too far behind to tell: report a change
            complete = self._logged_up_to(seen + 1, current, in_flight)
            if complete > seen:
                names = [f"{_EV_PREFIX}{r}" for r in range(seen + 1, complete + 1)]
                if not self._call(c.check, names):
                    # An abandoned revision in the range: read the logged ones one by one.
                    names = [n for n in names if self._call(c.check, [n])]
                got = self._fetch_events(seen + 1, names) if names else []
                if got is None:
                    return True, self.revision()  # the log moved on under us: report a change
                keys = [bytes(v).decode() for v in got]
                if any(k and k.startswith(prefix) for k in keys):
                    return True, self.revision()
                seen = complete
            remaining = deadline - self._clock.monotonic()
            if remaining <= 0:
                return False, seen
            rung, last_ring = last_ring < ring, ring  # the first pass counts as rung
            if channel and (seen >= current or not rung):
                # Logs read up to a write still in flight (if any): a write under the
                # prefix behind it rang before this read, so the channel alone could miss
                # it; bound the wait by IN_FLIGHT_S then, and read the log again.
                step = WAIT_STEP_S if seen >= current else IN_FLIGHT_S
                name, step = f"{_CH_PREFIX}{channel}{ring + 1}", min(remaining, step)
            else:
                # Rung, but the write is behind one in flight: follow the log to it.
                name = f"{_EV_PREFIX}{seen + 1}"
                step = min(remaining, WAIT_STEP_S if seen >= current else IN_FLIGHT_S)
            try:
                c.wait([name], timedelta(seconds=step))
            except RuntimeError as exc:
                if type(exc).__name__ == "DistNetworkError" or "timeout" not in str(exc).lower():
                    raise self._broken(exc) from exc

    def close(self) -> None:
        self._closed = True


__all__ = ["TcpStore", "TcpStoreServer", "probe", "StoreTimeout"]
