"""The tcp store's change log and watches: revisions, the event log, ring channels.

Owns what :meth:`~flexrun.store.tcp.TcpStore.revision` and
:meth:`~flexrun.store.tcp.TcpStore.wait_for_change` do, on the client's connections:
which revisions have landed, reading the event log, and waiting on a directory's ring
channel. The encoding is described in :mod:`flexrun.store.tcp`.

Wait tokens. :meth:`revision` also reads the ring count of every directory this client
has watched before, *before* the state the caller then reads, and keeps it under the
revision it returns. A later ``wait_for_change(dir, that_revision)`` then waits for the
next ring alone: any write under the directory that lands after the caller's read rings
above the kept count, so no event-log scan is needed (a scan reads every write since,
keep-alives included: with thousands of waiters that is the N^2 the rendezvous avoids).
A count that went down means the server restarted: a change is reported.

Precision. :meth:`ChangeLog.revision` looks for writes still in flight among the newest
``_NEWEST`` revisions only, and a cached ``get_prefix`` among the newest ``_RECENT`` (a check
costs a name per revision; with thousands of writers a wider search cost each reader more
than the rest of its reads together). A watch does not depend on it: a write that lands
late rings late, and a watch without a token waits on the ring after its scan too. A cached
``get_prefix`` needs no search beyond that: a full read searches the newest ``PRECISE``
revisions not yet known to have landed (once per revision and client), and a repeated read
checks every revision it catches up over. A write in flight for longer than ``PRECISE``
revisions (or abandoned and landing after ``IN_FLIGHT_S``) stays unseen until the next full
read, at least every ``FULL_READ_S`` (:mod:`flexrun.store.tcp_reads`).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flexrun.store.tcp import TcpStore

_REV_KEY = "__flexrun/rev"
_EV_PREFIX = "__flexrun/ev/"
_EPOCH_KEY = "__flexrun/epoch"
_INTERNAL = "__flexrun/"
_CH_COUNT = "__flexrun/chn/"
_CH_PREFIX = "__flexrun/ch/"
EVENT_WINDOW = 8192  # event keys kept (writers delete ev/<rev - EVENT_WINDOW>)
SCAN_LIMIT = 64  # a watch without a token further behind than this reports a change
TOKENS = 64  # revisions whose ring counts are kept for a later wait_for_change
# Longest single server-side wait: it bounds how late a waiter learns of a write whose
# writer died between logging it and ringing its channel. Each step costs a waiter two
# requests (the ring count, the wait): at 5 s, 4096 idle agents cost the server ~1600
# requests a second, nearly as many as their keep-alives (2000 at the default 2 s).
WAIT_STEP_S = 30.0
IN_FLIGHT_S = 1.0
BATCH = 512  # keys per multi_get request
_RECENT = 64  # how many of the newest revisions a cached get_prefix checks for writes in flight
_NEWEST = 8  # how many revision() checks (a watch does not depend on it, see Precision)
PRECISE = EVENT_WINDOW // 2  # how far back a full get_prefix looks for writes in flight


def event(key: str, raw: bytes | None) -> bytes:
    """The event log's entry for a write of ``raw`` to ``key``: the key, and a digest of
    what the value holds besides its revision, with which a reader that has the key's
    previous value can tell a renewal of it (a keep-alive) and rebuild it without reading
    it. Empty for a lost compare-and-set; without a digest when ``raw`` is not given."""
    if not key:
        return b""
    return key.encode() if raw is None else key.encode() + b"\n" + content_digest(raw)


def content_digest(raw: bytes) -> bytes:
    """A digest of a raw value without its revision (``<rev> <ttl>\n<payload>``)."""
    return hashlib.blake2b(raw.partition(b" ")[2], digest_size=8).hexdigest().encode()


def event_key(logged: bytes) -> tuple[str | None, bytes | None]:
    """The key an event log entry names, and its digest (None: not given). The key is None
    when the entry is not text (a stranger's write): the reader cannot tell which key
    changed, and reads as if any had."""
    key, sep, digest = logged.rpartition(b"\n")
    try:
        return (key.decode(), digest) if sep else (logged.decode(), None)
    except UnicodeDecodeError:
        return None, None


def dir_of(prefix: str) -> str:
    """The directory whose channel rings for every key under ``prefix`` ("" for none)."""
    return prefix[: prefix.rfind("/") + 1]


class ChangeLog:
    """Revisions and watches of one :class:`~flexrun.store.tcp.TcpStore` client."""

    def __init__(self, client: TcpStore) -> None:
        self.client = client
        self._clock = client._clock
        self._seen_lock = client._seen_lock
        self._in_flight: dict[int, float] = {}
        self._watched_dirs: set[str] = set()
        self._tokens: OrderedDict[int, dict[str, int]] = OrderedDict()
        self._complete = 0  # every revision up to this one is known to have landed

    def _c(self) -> Any:
        return self.client._c()

    def _call(self, fn: Any, *args: Any) -> Any:
        return self.client._call(fn, *args)

    def watching(self, directory: str) -> bool:
        with self._seen_lock:
            return directory in self._watched_dirs

    def watched(self, directory: str) -> None:
        with self._seen_lock:
            self._watched_dirs.add(directory)

    # -- revisions --------------------------------------------------------------------------
    def revision(self) -> int:
        """The highest revision below which every write has landed.

        The counter may be ahead of the data: a writer takes its revision first and its
        write lands a moment later. State read "at" the raw counter could miss that write,
        and a watch from there would skip it; so report the revision just below the oldest
        write still in flight (one abandoned for IN_FLIGHT_S by a dead writer is ignored).
        """
        return self._revision(_NEWEST)

    def _revision(self, window: int) -> int:
        """:meth:`revision`, looking for writes in flight among the newest ``window`` (the
        precise window also skips what an earlier precise call found complete)."""
        with self._seen_lock:
            dirs = sorted(self._watched_dirs)
        rings = {d: self.client._add(f"{_CH_COUNT}{d}", 0) for d in dirs}
        current = self.client._add(_REV_KEY, 0)
        precise = window >= _RECENT
        with self._seen_lock:
            if current < self._complete:
                self._complete = 0  # a restarted server counts from 1 again
            lo = max(1, current - window + 1, self._complete + 1 if precise else 1)
            # What the search covered is complete if it reached the last complete revision
            # (a search PRECISE deep: what it did not reach is taken as landed).
            covers = precise and (lo <= self._complete + 1 or window >= PRECISE)
        rev = self._logged_up_to(lo, current, self._in_flight)
        with self._seen_lock:
            if covers:
                self._complete = max(self._complete, rev)
            if rings:
                self._tokens[rev] = rings
                self._tokens.move_to_end(rev)
                while len(self._tokens) > TOKENS:
                    self._tokens.popitem(last=False)
        return rev

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

    def _fetch_events(self, oldest: int, names: list[str]) -> list[Any] | None:
        """``multi_get`` of keys just checked to exist, event keys from revision ``oldest``
        on; None if writers may prune the oldest meanwhile (``TCPStore.get`` of a missing
        key blocks until the op timeout: seen with 1024 agents, whose burst of writes pushed
        the event window past a reader between its check and its read)."""
        if self.client._add(_REV_KEY, 0) - oldest >= EVENT_WINDOW // 2:
            return None
        return list(self._call(self._c().multi_get, names))

    # -- waiting ----------------------------------------------------------------------------
    def wait_for_change(
        self, prefix: str, since_revision: int, timeout_s: float
    ) -> tuple[bool, int]:
        deadline = self._clock.monotonic() + timeout_s
        channel = dir_of(prefix)
        if channel:
            self.client._watch(channel)
            with self._seen_lock:
                token = self._tokens.get(since_revision, {}).get(channel)
            if token is not None and prefix == channel:
                return self._wait_ring(channel, token, since_revision, deadline)
        return self._scan_and_wait(prefix, channel, since_revision, deadline)

    def _wait_ring(self, channel: str, count: int, since: int, deadline: float) -> tuple[bool, int]:
        """Wait for the ring after ``count`` (read before the caller's state read)."""
        while True:
            ring = self.client._add(f"{_CH_COUNT}{channel}", 0)
            c = self._c()
            if ring != count:  # rung since (or, below, a restarted server)
                return True, self.revision()
            remaining = deadline - self._clock.monotonic()
            if remaining <= 0:
                return False, since
            self._server_wait(c, f"{_CH_PREFIX}{channel}{count + 1}", min(remaining, WAIT_STEP_S))

    def _server_wait(self, c: Any, name: str, step_s: float) -> None:
        try:
            c.wait([name], timedelta(seconds=step_s))
        except RuntimeError as exc:
            if type(exc).__name__ == "DistNetworkError" or "timeout" not in str(exc).lower():
                raise self.client._broken(exc) from exc

    def _scan_and_wait(
        self, prefix: str, channel: str, since: int, deadline: float
    ) -> tuple[bool, int]:
        """Without a token: read the event log from ``since``, then wait on the channel
        (or on the log itself for a prefix with no directory)."""
        seen = since
        in_flight: dict[int, float] = {}
        last_ring: int | None = None
        while True:
            # Read the ring count *before* the log: a write logged after this read rings
            # a number above it, one logged before is found in the log.
            ring = self.client._add(f"{_CH_COUNT}{channel}", 0) if channel else 0
            if last_ring is not None and ring != last_ring and prefix == channel:
                return True, self.revision()  # rung: a write under the directory
            current = self.client._add(_REV_KEY, 0)
            c = self._c()
            if current - seen > SCAN_LIMIT:
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
                keys = [event_key(bytes(v))[0] for v in got]
                if any(k is None or k.startswith(prefix) for k in keys):
                    return True, self.revision()
                seen = complete
            remaining = deadline - self._clock.monotonic()
            if remaining <= 0:
                return False, seen
            rung = last_ring is None or last_ring < ring  # the first pass counts as rung
            last_ring = ring
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
            self._server_wait(c, name, step)
