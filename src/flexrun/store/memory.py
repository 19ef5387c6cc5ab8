"""An in-process store for unit tests: exact semantics, injectable clock, no I/O."""

from __future__ import annotations

import threading
from collections.abc import Mapping

from flexrun._clock import SYSTEM_CLOCK, Clock
from flexrun.store.api import Entry, Event


class MemoryStore:
    """Thread-safe dict with revisions, TTL keys and a condition variable for watches."""

    def __init__(self, clock: Clock = SYSTEM_CLOCK) -> None:
        self._clock = clock
        self._cond = threading.Condition()
        self._data: dict[str, tuple[Entry, float | None]] = {}
        self._rev = 0
        # Every recent write (revision, key, what it wrote; None: a delete), for watches.
        self._writes: list[tuple[int, str, Entry | None]] = []
        self._forgotten = 0
        self._closed = False

    def _live(self, key: str) -> Entry | None:
        item = self._data.get(key)
        if item is None:
            return None
        entry, expires = item
        if expires is not None and self._clock.monotonic() >= expires:
            del self._data[key]
            return None
        return entry

    def _write(self, key: str, value: bytes | None, ttl_s: float | None) -> Entry | None:
        self._rev += 1
        if len(self._writes) >= 4096:
            self._forgotten = self._writes[1023][0]  # writes up to here are no longer listed
            del self._writes[:1024]
        if value is None:
            self._data.pop(key, None)
            entry = None
        else:
            entry = Entry(value, self._rev)
            expires = None if ttl_s is None else self._clock.monotonic() + ttl_s
            self._data[key] = (entry, expires)
        self._writes.append((self._rev, key, entry))
        self._cond.notify_all()
        return entry

    def get(self, key: str) -> Entry | None:
        with self._cond:
            return self._live(key)

    def get_prefix(self, prefix: str) -> dict[str, Entry]:
        with self._cond:
            out = {}
            for key in sorted(k for k in self._data if k.startswith(prefix)):
                entry = self._live(key)
                if entry is not None:
                    out[key] = entry
            return out

    def put(self, key: str, value: bytes, *, ttl_s: float | None = None) -> int:
        with self._cond:
            entry = self._write(key, bytes(value), ttl_s)
            assert entry is not None
            return entry.revision

    def compare_and_set(
        self, key: str, value: bytes, *, expected_revision: int
    ) -> tuple[bool, Entry | None]:
        with self._cond:
            current = self._live(key)
            current_rev = current.revision if current is not None else 0
            if current_rev != expected_revision:
                return False, None
            return True, self._write(key, bytes(value), None)

    def put_many(self, items: Mapping[str, bytes]) -> int:
        with self._cond:
            rev = 0
            for key, value in items.items():
                entry = self._write(key, bytes(value), None)
                assert entry is not None
                rev = entry.revision
            return rev

    def delete_prefix(self, prefix: str) -> None:
        if not prefix:
            raise ValueError("delete_prefix needs a non-empty prefix")
        with self._cond:
            for key in [k for k in self._data if k.startswith(prefix)]:
                self._write(key, None, None)

    def delete(self, key: str) -> None:
        with self._cond:
            if key in self._data:
                self._write(key, None, None)

    def revision(self) -> int:
        with self._cond:
            return self._rev

    def wait_for_change(
        self, prefix: str, since_revision: int, timeout_s: float
    ) -> tuple[bool, int]:
        deadline = self._clock.monotonic() + timeout_s
        with self._cond:
            while True:
                if since_revision < self._forgotten:
                    return True, self._rev  # too far behind to tell: report a change
                if any(r > since_revision and k.startswith(prefix) for r, k, _ in self._writes):
                    return True, self._rev
                remaining = deadline - self._clock.monotonic()
                if remaining <= 0 or self._closed:
                    return False, self._rev
                self._cond.wait(min(remaining, 0.5))

    def get_prefix_at(self, prefix: str) -> tuple[dict[str, Entry], int]:
        """:meth:`get_prefix` and the revision it is as of (see the api)."""
        with self._cond:
            self._expire(prefix)
            return self.get_prefix(prefix), self._rev

    def watch_values(
        self, prefix: str, since_revision: int, timeout_s: float
    ) -> tuple[list[Event] | None, int]:
        """The writes under ``prefix`` after ``since_revision`` (see the api); an expired
        keep-alive is reported as a delete, as etcd reports a lease's expiry."""
        deadline = self._clock.monotonic() + timeout_s
        with self._cond:
            while True:
                if since_revision < self._forgotten:
                    return None, self._rev
                self._expire(prefix)
                events: list[Event] = [
                    (k, e) for r, k, e in self._writes if r > since_revision and k.startswith(prefix)
                ]
                if events:
                    return events, self._rev
                remaining = deadline - self._clock.monotonic()
                if remaining <= 0 or self._closed:
                    return [], max(since_revision, self._rev)
                self._cond.wait(min(remaining, 0.5))

    def _expire(self, prefix: str) -> None:
        """Record the expiry of every keep-alive under ``prefix`` whose TTL has passed."""
        now = self._clock.monotonic()
        for key in [
            k
            for k, (_, expires) in self._data.items()
            if k.startswith(prefix) and expires is not None and now >= expires
        ]:
            self._write(key, None, None)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
