"""Reporting the store records a reader ignored, at a bounded rate.

Owns :class:`Rejects`: what a store (or a rendezvous reader above it) does with a record it
cannot decode, verify or parse once it has decided to treat it as absent: one warning in
the log and one call of each sink (``store_record_rejected`` in the event log), at most once
per key and reason every ``every_s`` seconds and at most ``burst`` reports per window
overall. Whoever can write to the store can write any number of junk keys; neither the log
nor this reader's memory may grow with them. It does not decide what is junk.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from flexrun._clock import SYSTEM_CLOCK, Clock

log = logging.getLogger("flexrun.store")

Sink = Callable[[str, str], None]
"""Called with (key, reason) for each reported record."""

KEPT = 1024  # (key, reason) pairs remembered for the per-key limit


class Rejects:
    """Rate-limited reports of ignored records (see the module docstring)."""

    def __init__(
        self,
        what: str = "ignored a store record that does not verify",
        *,
        every_s: float = 60.0,
        burst: int = 20,
        sink: Sink | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self._what = what
        self._every_s = every_s
        self._burst = burst
        self._clock = clock
        self._lock = threading.Lock()
        self._last: dict[tuple[str, str], float] = {}
        self._window_start = -float("inf")
        self._in_window = 0
        self._suppressed = 0
        self._sinks: list[Sink] = [] if sink is None else [sink]
        self.count = 0  # every record reported, suppressed ones included

    def add_sink(self, sink: Sink) -> None:
        with self._lock:
            self._sinks.append(sink)

    def report(self, key: str, reason: str) -> None:
        """Report that the record under ``key`` was ignored for ``reason``."""
        key = key[:200]
        reason = reason[:200]
        now = self._clock.monotonic()
        with self._lock:
            self.count += 1
            last = self._last.get((key, reason))
            if last is not None and now - last < self._every_s:
                return
            if now - self._window_start >= self._every_s:
                if self._suppressed:
                    log.warning(
                        "%s: %d more not reported in the last %gs",
                        self._what,
                        self._suppressed,
                        self._every_s,
                    )
                self._window_start, self._in_window, self._suppressed = now, 0, 0
            if self._in_window >= self._burst:
                self._suppressed += 1
                return
            self._in_window += 1
            self._last[(key, reason)] = now
            if len(self._last) > KEPT:
                for old in sorted(self._last, key=self._last.__getitem__)[: KEPT // 2]:
                    del self._last[old]
            sinks = list(self._sinks)
        log.warning("%s: %r (%s)", self._what, key, reason)
        for sink in sinks:
            sink(key, reason)


def report_to(store: object, sink: Sink) -> None:
    """Send the records ``store`` ignores to ``sink``: those of every layer that reports
    them (a :class:`~flexrun.store.signed.SignedStore` and the backend under it)."""
    seen: set[int] = set()
    layer: object | None = store
    while layer is not None and id(layer) not in seen:
        seen.add(id(layer))
        add = getattr(layer, "add_sink", None)
        if callable(add):
            add(sink)
        elif isinstance(getattr(layer, "rejects", None), Rejects):
            layer.rejects.add_sink(sink)  # type: ignore[attr-defined]
        layer = getattr(layer, "inner", None)


__all__ = ["Rejects", "Sink", "report_to"]
