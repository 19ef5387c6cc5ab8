"""One long store watch per node, so that an agent's short waits cost the store nothing.

Owns a background thread that keeps one bounded ``wait_for_change`` open on what the node
watches, from the revision of its last read, and a local flag that the agent's
:meth:`RendezvousHandler.wait` (called every monitor interval, 0.1 s) waits on. Without it
every tick of every agent is a store request: 10 per second per node, 100,000 per second
at 10,000 nodes (etcd: a watch request each). It decides nothing.
"""

from __future__ import annotations

import logging
import threading

from flexrun.errors import StoreError
from flexrun.store.api import Store

log = logging.getLogger("flexrun.rendezvous")

LONG_WAIT_S = 30.0  # one store wait lasts at most this long (then it is renewed)
RETRY_S = 0.5  # after a failed wait (the store is down): pause, report a change, retry


class ChangeWatch:
    """``wait(t)``: whether what the node watches changed since it was last ``arm``ed."""

    def __init__(self, store: Store, stop: threading.Event) -> None:
        self._store = store
        self._stop = stop
        self._cond = threading.Condition()
        self._prefix = ""
        self._since = -1
        self._generation = 0
        self._changed = False
        self._thread: threading.Thread | None = None

    def arm(self, prefix: str, since: int) -> None:
        """The node has read everything up to revision ``since``: watch ``prefix`` from there."""
        with self._cond:
            if (prefix, since) != (self._prefix, self._since):
                self._prefix, self._since = prefix, since
                self._generation += 1
            self._changed = False
            self._cond.notify_all()

    def wait(self, timeout_s: float) -> bool:
        """Block until a change since the last :meth:`arm`, or ``timeout_s``."""
        with self._cond:
            if self._thread is None and self._since >= 0:
                self._thread = threading.Thread(
                    target=self._loop, name="flexrun-rdzv-watch", daemon=True
                )
                self._thread.start()
            self._cond.wait_for(lambda: self._changed or self._stop.is_set(), timeout_s)
            return self._changed

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
            try:
                changed, _ = self._store.wait_for_change(prefix, since, LONG_WAIT_S)
            except StoreError as exc:
                log.debug("watch of %s failed (%s): reporting a change", prefix, exc)
                changed = True
                self._stop.wait(RETRY_S)
            if changed:
                with self._cond:
                    if generation == self._generation:
                        self._changed = True
                        self._cond.notify_all()


__all__ = ["ChangeWatch", "LONG_WAIT_S"]
