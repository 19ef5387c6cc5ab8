"""One long store watch per node, so that an agent's short waits cost the store nothing.

Owns a background thread that keeps one bounded ``wait_for_change`` open on what the node
watches, from the revision of its last read, and a local flag that the agent's
:meth:`RendezvousHandler.wait` (called every monitor interval, 0.1 s) waits on. Without it
every tick of every agent is a store request: 10 per second per node, 100,000 per second
at 10,000 nodes (etcd: a watch request each). It decides nothing.

Where the store's notifications carry the written values (the api's optional
``get_prefix_at`` and ``watch_values``: etcd), a prefix armed with ``copy=True`` is also
kept as a local copy: read once when armed, then brought up to date from the events the
watch delivers anyway. :meth:`ChangeWatch.read` answers a read of a key under it from the
copy, at no request. A follower's round directory (header, watcher claim, masters) is
such a prefix: without the copy a new round costs each follower about four reads (the
header, the claim, the master address, read once before and once after rank 0 published
it), each of them etcd server CPU multiplied by the number of nodes; from the copy it costs
none. A
copy lags the store by the watch's delivery (as a read does by its round trip): a change
it has not applied yet wakes the next :meth:`wait`. A broken or compacted watch drops the
copy (reads go to the store until it is read again); a watch that saw nothing for
``LONG_WAIT_S`` reads the prefix again rather than watch on from an old revision.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable

from flexrun.errors import StoreError
from flexrun.store.api import Entry, Event, Store, WatchesValues

log = logging.getLogger("flexrun.rendezvous")

LONG_WAIT_S = 30.0  # one store wait lasts at most this long (then it is renewed)
JITTER = 0.5  # each node's waits last LONG_WAIT_S x [1, 1 + JITTER): the nodes of a job that
# joined together do not renew (and, with a copy, read their prefix again) all at once
RETRY_S = 0.5  # after a failed wait (the store is down): pause, report a change, retry


class ChangeWatch:
    """``wait(t)``: whether what the node watches changed since it was last ``arm``ed."""

    def __init__(self, store: Store, stop: threading.Event) -> None:
        self._store = store
        self._stop = stop
        self._cond = threading.Condition()
        self._prefix = ""
        self._since = -1
        self._copy_wanted = False
        self._generation = 0
        self._changed = False
        self._interrupted = False
        self._thread: threading.Thread | None = None
        self._long_wait_s = LONG_WAIT_S * (1 + JITTER * random.random())
        self._prime: Callable[[str], tuple[dict[str, Entry], int]] | None = None
        self._watch_values: Callable[[str, int, float], tuple[list[Event] | None, int]] | None
        self._watch_values = None
        if isinstance(store, WatchesValues):  # (both or neither)
            self._prime, self._watch_values = store.get_prefix_at, store.watch_values
        # The copy: (prefix, key -> entry, revision it is complete up to); None: none kept.
        self._copy: tuple[str, dict[str, Entry], int] | None = None

    def arm(self, prefix: str, since: int, *, copy: bool = False) -> None:
        """The node has read everything up to revision ``since``: watch ``prefix`` from
        there (and keep it as a local copy, where the store allows, with ``copy``)."""
        with self._cond:
            copy = copy and self._prime is not None
            if (prefix, since, copy) != (self._prefix, self._since, self._copy_wanted):
                self._prefix, self._since, self._copy_wanted = prefix, since, copy
                self._generation += 1
            if self._copy is not None and (not copy or self._copy[0] != prefix):
                self._copy = None
            # A copy that got past ``since`` (events applied after the node read it, before
            # it armed) is a change the node has not seen: the copy's watch waits for later
            # events only, so the wake-up is now or never.
            self._changed = self._copy is not None and self._copy[2] > since
            self._cond.notify_all()

    def read(self, key: str) -> tuple[Entry | None, int] | None:
        """``key``'s entry from the local copy and the revision the copy is complete up to
        (pass that to :meth:`arm`); None when no copy covers ``key`` (read the store)."""
        with self._cond:
            if self._copy is None or not key.startswith(self._copy[0]):
                return None
            _, values, rev = self._copy
            return values.get(key), rev

    def wait(self, timeout_s: float) -> bool:
        """Block until a change since the last :meth:`arm`, an :meth:`interrupt`, or
        ``timeout_s``; whether there was a change."""
        with self._cond:
            if self._thread is None and self._since >= 0:
                self._thread = threading.Thread(
                    target=self._loop, name="flexrun-rdzv-watch", daemon=True
                )
                self._thread.start()
            self._cond.wait_for(
                lambda: self._changed or self._interrupted or self._stop.is_set(), timeout_s
            )
            self._interrupted = False
            return self._changed

    def interrupt(self) -> None:
        """End the current :meth:`wait` (or the next one, if none is waiting) now, as a
        change would, without reporting a change. Any thread."""
        with self._cond:
            self._interrupted = True
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._cond:
                self._cond.wait_for(lambda: not self._changed or self._stop.is_set(), 1.0)
                if self._changed or self._stop.is_set():
                    continue
                prefix, since, generation = self._prefix, self._since, self._generation
                wanted = self._copy_wanted
                copy = self._copy if wanted else None
            try:
                if wanted:
                    self._follow_copy(prefix, copy)
                    continue
                changed, _ = self._store.wait_for_change(prefix, since, self._long_wait_s)
            except Exception as exc:  # noqa: BLE001 (a dead watch thread: a node never woken)
                if isinstance(exc, StoreError):
                    log.debug("watch of %s failed (%s): reporting a change", prefix, exc)
                else:
                    log.exception("watch of %s failed: reporting a change", prefix)
                with self._cond:
                    self._copy = None
                    self._wake()
                self._stop.wait(RETRY_S)
                continue
            if changed:
                with self._cond:
                    if generation == self._generation:
                        self._wake()

    def _wake(self) -> None:
        self._changed = True
        self._cond.notify_all()

    def _follow_copy(self, prefix: str, copy: tuple[str, dict[str, Entry], int] | None) -> None:
        """Read ``prefix`` into a copy if none is kept, else apply the next events to it;
        wake the node when the copy got past what it last read (the revision it armed)."""
        assert self._prime is not None and self._watch_values is not None
        if copy is None:
            values, rev = self._prime(prefix)
            with self._cond:
                if self._copy_wanted and self._prefix == prefix and self._copy is None:
                    self._copy = (prefix, dict(values), rev)
                    self._wake()  # (a new copy: the node reads it)
            return
        _, values, rev = copy
        events, new_rev = self._watch_values(prefix, rev, self._long_wait_s)
        if events == []:
            # A quiet prefix: the copy's revision falls behind the store's, and a watch
            # opened from far back costs etcd a scan of the history since (an "unsynced"
            # watcher: at 4096 nodes that scan starved the store). Read it again instead:
            # one small read, and the next watch starts from now.
            fresh, at = self._prime(prefix)
            with self._cond:
                if self._copy is copy:
                    self._copy = (prefix, dict(fresh), at)
                    if {k: e.revision for k, e in fresh.items()} != {
                        k: e.revision for k, e in values.items()
                    }:
                        self._wake()
            return
        with self._cond:
            if self._copy is not copy:
                return  # dropped or re-armed meanwhile: the next pass starts over
            if events is None:
                self._copy = None  # history compacted: read the prefix again
                self._wake()
                return
            for key, entry in events:
                if entry is None:
                    values.pop(key, None)
                else:
                    values[key] = entry
            rev = max(rev, new_rev)
            self._copy = (prefix, values, rev)
            if events and rev > self._since:
                self._wake()


__all__ = ["ChangeWatch", "LONG_WAIT_S"]
