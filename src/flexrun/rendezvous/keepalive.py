"""A node's keep-alive: the thread that refreshes it, and what its defaults cost at scale.

Owns the refresh loop (one store write every ``heartbeat_interval``; a failing store is
logged once and retried) and the reasoning behind :func:`keepalive_defaults` (defined in
``flexrun.config``, which applies it), the interval and timeout a job of N nodes gets when
it does not set them. It does not judge anyone's keep-alive (the watcher does,
:mod:`flexrun.rendezvous.watcher`).

Defaults. N nodes refresh N / interval keep-alives per second. The tcp store's budget for
them is :data:`BEATS_PER_S` = 2000/s (about 4 requests each, a small share of its server's
CPU): interval max(1 s, N / 2000 s), timeout five intervals (readers judge
the age themselves and must see renewals). etcd's is ``backends.ETCD.keepalives_per_s`` = 500/s: one
lease keep-alive each (the value re-written every TTL), but every request through etcd's
JSON gateway costs its server a fixed share of CPU whatever it does, and
the server expires the lease itself, so a renewal every TTL/3 suffices (etcd's own client's
rule): timeout max(5, 3N / 500) s in whole seconds, interval a third of it. Loss detection
takes the timeout plus one of the watcher's steps.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from flexrun.config import KEEPALIVES_PER_S as BEATS_PER_S
from flexrun.config import keepalive_defaults
from flexrun.errors import StoreError

log = logging.getLogger("flexrun.rendezvous")


class KeepAlive:
    """Calls ``beat`` every ``interval_s`` from a daemon thread until ``stop`` is set."""

    def __init__(self, beat: Callable[[], None], interval_s: float, stop: threading.Event) -> None:
        self._beat = beat
        self._interval_s = interval_s
        self._stop = stop
        self._failing = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="flexrun-heartbeat", daemon=True)
        self._thread.start()

    def join(self, timeout_s: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)

    def _loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self._beat()
                if self._failing:
                    log.warning("store reachable again; keep-alive resumed")
                    self._failing = False
            except StoreError as exc:
                if not self._failing:
                    log.warning("keep-alive failed (will retry): %s", exc)
                    self._failing = True
            except Exception:  # noqa: BLE001 (a dead keep-alive thread: a node taken for lost)
                # Not a store failure: a bug, logged with its traceback (once until a beat
                # succeeds again) while the node keeps beating.
                if not self._failing:
                    log.exception("keep-alive failed unexpectedly (will retry)")
                    self._failing = True


__all__ = ["BEATS_PER_S", "KeepAlive", "keepalive_defaults"]
