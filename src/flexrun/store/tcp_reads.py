"""The tcp store's ``get_prefix``: incremental reads from the event log, full reads now
and then, and what several prefixes' reads share.

Owns the last read of each prefix (its raw values and the revision they are complete up
to). A repeated read fetches only the keys the event log names since then, after checking
that each of those revisions has landed; a full read is taken at a revision below which every
write has landed (searched for writes in flight as far back as ``PRECISE`` revisions), so the
reads that follow it miss no write in flight during it. Everything is read again when the log
cannot tell (a restarted server, a revision abandoned by a dead writer, a log that moved on
past half its window), and at least every ``FULL_READ_S`` (for writes in flight longer than
that search reaches, see Precision in :mod:`flexrun.store.tcp_watch`): it is long because precise full reads
need no frequent correction, and at thousands of nodes each full read of a prefix (a listing
and a value per node) is the most expensive read there is.

Shared reads. The watcher reads three prefixes a step (node records, keep-alives, asks),
whose incremental reads cover the same revisions and whose full reads fall due together.
One listing of the server's keys serves the full reads of every prefix for ``LISTING_S``
(a listing names every key on the server, so at thousands of nodes three listings every
``FULL_READ_S`` would be the largest share of a round's bytes); a prefix read from an older listing is brought up to date
from the event log like any cached read. The keys named by the event log are kept for the
newest revisions, so each revision's name is fetched once, not once per prefix.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from flexrun.store.tcp_watch import (
    _EPOCH_KEY,
    _EV_PREFIX,
    _INTERNAL,
    _RECENT,
    BATCH,
    EVENT_WINDOW,
    PRECISE,
    content_digest,
    event_key,
)

if TYPE_CHECKING:
    from flexrun.store.tcp import TcpStore

SNAPSHOTS = 16  # prefixes whose last get_prefix is kept for an incremental re-read
FULL_READ_S = 60.0  # a kept get_prefix is read in full again at least this often
LISTING_S = 1.0  # a listing of the server's keys serves full reads of other prefixes this long


class PrefixReads:
    """The ``get_prefix`` reads of one :class:`~flexrun.store.tcp.TcpStore` client."""

    def __init__(self, client: TcpStore) -> None:
        self._client = client
        self._log = client._log
        self._clock = client._clock
        self._lock = client._seen_lock
        # prefix -> (server epoch, revision, key -> raw value): the last read, brought up to
        # date from the event log by the next one (a restarted server has another epoch)
        self._snapshots: dict[str, tuple[bytes, int, dict[str, bytes]]] = {}
        self._full_at: dict[str, float] = {}  # prefix -> when it was last read in full
        # The last listing of the server's keys: (epoch, revision, when, keys but internal).
        self._listing: tuple[bytes, int, float, list[str]] | None = None
        # Keys the event log named for recent revisions, and the server epoch they are of.
        self._names: dict[int, tuple[str, bytes | None]] = {}  # revision -> (key, digest)
        self._names_epoch = b""

    def _c(self) -> Any:
        return self._client._c()

    def _call(self, fn: Any, *args: Any) -> Any:
        return self._client._call(fn, *args)

    def forget(self, prefix: str) -> None:
        """Keys under ``prefix`` were removed from the server without events: forget every
        read that may name them."""
        with self._lock:
            self._listing = None
            for p in [p for p in self._snapshots if p.startswith(prefix) or prefix.startswith(p)]:
                del self._snapshots[p]

    def read(self, prefix: str) -> dict[str, bytes]:
        """The raw values of every key under ``prefix``; a repeated call fetches only what
        was written since the last one (the event log names those keys), not every key
        again, and everything at least every FULL_READ_S (from a listing of the server's
        keys shared with other prefixes' full reads, see Shared reads)."""
        with self._lock:
            snap = self._snapshots.get(prefix)
        raws: dict[str, bytes] | None = None
        epoch = b""
        now = self._clock.monotonic()
        fresh = now - self._full_at.get(prefix, now - FULL_READ_S) < FULL_READ_S
        if snap is not None and fresh:
            at = self._log._revision(_RECENT)  # every write up to here has landed and is logged
            if 0 <= at - snap[1] <= EVENT_WINDOW // 2:
                epoch = snap[0]
                raws = self._catch_up(prefix, snap, at)
        if raws is None:
            with self._lock:
                self._full_at[prefix] = now
            at = self._log._revision(PRECISE)  # (below it, nothing is in flight: see above)
            epoch, raws = self._full_read(prefix, at, now)
        with self._lock:
            old = self._snapshots.get(prefix)
            if old is None or old[1] <= at:
                self._snapshots[prefix] = (epoch, at, raws)
                if len(self._snapshots) > SNAPSHOTS:
                    del self._snapshots[next(iter(self._snapshots))]
        return raws

    def _full_read(self, prefix: str, at: int, now: float) -> tuple[bytes, dict[str, bytes]]:
        """Every key under ``prefix`` as of revision ``at``, and the server's epoch: from the
        listing another prefix's full read made within LISTING_S (then brought up to ``at``
        from the event log), else from a new listing."""
        c = self._c()
        # This server's epoch: created by the first reader, gone if the server restarts.
        epoch = bytes(self._call(c.compare_set, _EPOCH_KEY, b"", os.urandom(8).hex().encode()))
        with self._lock:
            listing = self._listing
        if listing is not None and (
            listing[0] != epoch
            or now - listing[2] >= LISTING_S
            or not 0 <= at - listing[1] <= EVENT_WINDOW // 2
        ):
            listing = None
        if listing is not None:
            raws = self._catch_up(prefix, (epoch, listing[1], self._values(prefix, listing[3])), at)
            if raws is not None:
                return epoch, raws
        keys = [k for k in self._client._junk.list_keys() if not k.startswith(_INTERNAL)]
        with self._lock:
            self._listing = (epoch, at, now, keys)
        return epoch, self._values(prefix, keys)

    def _values(self, prefix: str, listed: list[str]) -> dict[str, bytes]:
        """The raw values of the ``listed`` keys under ``prefix``."""
        return self._get_many(sorted(k for k in listed if k.startswith(prefix)))

    def _get_many(self, keys: list[str]) -> dict[str, bytes]:
        """The raw values of ``keys``, which exist (BATCH keys a request)."""
        c = self._c()
        raws: dict[str, bytes] = {}
        for i in range(0, len(keys), BATCH):
            part = keys[i : i + BATCH]
            raws.update(zip(part, map(bytes, self._call(c.multi_get, part)), strict=True))
        return raws

    def _catch_up(
        self, prefix: str, snap: tuple[bytes, int, dict[str, bytes]], at: int
    ) -> dict[str, bytes] | None:
        """A snapshot's keys updated to revision ``at``; None: the log cannot tell. The
        event log's names of revisions another read fetched already are not fetched again,
        and a key whose newest event's digest matches the value kept (a keep-alive renewed
        unchanged) is rebuilt at its new revision without a read of its value."""
        c = self._c()
        epoch, since, raws = snap
        wanted: list[int] = []
        events: dict[int, tuple[str, bytes | None]] = {}
        with self._lock:
            known = self._names if self._names_epoch == epoch else {}
            for r in range(since + 1, at + 1):
                if r in known:
                    events[r] = known[r]
                else:
                    wanted.append(r)
        names = [_EPOCH_KEY] + [f"{_EV_PREFIX}{r}" for r in wanted]
        if not self._call(c.check, names):
            return None  # a restarted server, a revision abandoned by a dead writer
        got = self._log._fetch_events(wanted[0] if wanted else at, names)
        if got is None or bytes(got[0]) != epoch:
            return None  # a restarted server that has been written to since
        named = [(r, event_key(bytes(v))) for r, v in zip(wanted, got[1:], strict=True)]
        if any(key is None for _, (key, _) in named):
            return None  # an entry that is not text (a stranger's): read everything
        fetched = {r: (str(key), digest) for r, (key, digest) in named}
        self._keep_names(epoch, fetched, at)
        events.update(fetched)
        newest: dict[str, tuple[int, bytes | None]] = {}
        for r in sorted(events):
            key, digest = events[r]
            if key and key.startswith(prefix) and not key.startswith(_INTERNAL):
                newest[key] = (r, digest)
        out = dict(raws)
        unknown: list[str] = []
        for key, (r, digest) in newest.items():
            kept = raws.get(key)
            rev = kept.partition(b" ")[0] if kept is not None else b""
            if digest is None or kept is None or content_digest(kept) != digest:
                unknown.append(key)
            elif not rev.isdigit():
                unknown.append(key)  # (junk under the key: read it again)
            elif int(rev) < r:  # (a full read may hold a newer one)
                out[key] = f"{r} ".encode() + kept.partition(b" ")[2]
        new = sorted(k for k in unknown if k not in raws)
        if new and not self._call(self._c().check, new):
            # A key the log names that is not on the server (a stranger's entry): reading
            # it would block for the op timeout.
            gone = {k for k in new if not self._call(self._c().check, [k])}
            unknown = [k for k in unknown if k not in gone]
        if unknown:
            out.update(self._get_many(sorted(unknown)))
        return out

    def _keep_names(
        self, epoch: bytes, names: dict[int, tuple[str, bytes | None]], at: int
    ) -> None:
        """Remember the keys the event log named; past half a window of them, those older
        than a quarter window go (at once: not one rebuild per catch-up from then on)."""
        with self._lock:
            if self._names_epoch != epoch:
                self._names, self._names_epoch = {}, epoch
            self._names.update(names)
            if len(self._names) > EVENT_WINDOW // 2:
                floor = at - EVENT_WINDOW // 4
                self._names = {r: k for r, k in self._names.items() if r > floor}


__all__ = ["FULL_READ_S", "LISTING_S", "PrefixReads"]
