"""Live mode's two ways of getting an epoch's process group, chosen once per worker.

Owns the choice and the in-place way. ``fresh``: a new ``ProcessGroupGloo`` per epoch (every
torch; ``flexrun.train.live_group`` builds it). ``reconfigure`` (torch >= 2.14, where
``ProcessGroupGloo`` takes ``enable_reconfigure`` and has ``reconfigure``; not turned off
with ``FLEXRUN_LIVE_RECONFIGURE=0``): each worker keeps one reconfigurable gloo group,
never the default process group (the sharded path's shard collectives use that one), and
each epoch re-forms it in place around the epoch's members, with torch's experimental
``reconfigure``: the members post their group's handle in their arrival report, the rank is
the position in the member list, the uuid is the epoch number + 1 (a process may use a uuid
once; epochs only grow).

What was measured on torch 2.15.0 (``bench/results/reconfigure.txt``): a collective that was
pending when its peer died stays pending on the re-formed group until its own timeout, and
holds one of the group's worker threads meanwhile, while new collectives run. So a worker
whose last group still has an abandoned collective in flight builds a new reconfigurable
group (a world of 1, under a new id) instead of re-forming that one; the old one is leaked
like the fresh path's old groups.

Falling back: if torch's reconfigure itself fails (an error, or no completion within the
timeout while the epoch stands), the worker emits ``live_group_fallback`` and forms a fresh
group for that same epoch (a cause shared by every member, such as a restarted store that
broke the group's store connection, sends them all there together), then stops posting a
handle, so every later epoch it is in forms fresh groups too (an epoch re-forms in place only
when every member posted a handle). It does not exchange reports or decide membership
(``flexrun.train.live_group``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from flexrun.errors import LiveAborted
from flexrun.train.live_sync import leak

log = logging.getLogger("flexrun.train.live")

FRESH = "fresh"
RECONFIGURE = "reconfigure"


def unsupported_reason(enabled: bool) -> str | None:
    """Why this worker cannot re-form groups in place (None: it can)."""
    if not enabled:
        return "turned off (FLEXRUN_LIVE_RECONFIGURE=0)"
    if not hasattr(dist.ProcessGroupGloo, "reconfigure") or _options() is None:
        return f"torch {torch.__version__} has no in-place reconfigure (needs >= 2.14)"
    return None


def _options() -> Any:
    cls = getattr(dist.distributed_c10d, "ReconfigureOptions", None)
    return cls() if cls is not None else None


class InPlaceGroups:
    """This worker's reconfigurable gloo group and its re-forming, or nothing (``path`` is
    ``fresh``) where torch cannot or the user turned it off."""

    def __init__(
        self,
        *,
        enabled: bool,
        timeout_s: float,
        namespace: str,
        raw_store: Callable[[], Any],
        emit: Callable[..., None],
    ) -> None:
        self.reason = unsupported_reason(enabled)
        self.path = FRESH if self.reason else RECONFIGURE
        """The path chosen at start."""
        self.timeout_s = timeout_s
        self._namespace = namespace
        self._raw = raw_store
        self._emit = emit
        self._pg: Any = None
        self._stale: list[Any] = []  # collectives abandoned on self._pg, maybe still pending
        self.inflight: Any = None
        """The collective the worker waits for (the epoch group's or a subgroup's)."""
        self.formed = FRESH
        """How the current epoch's group was made."""
        emit("live_group_path", group_path=self.path, reason=self.reason)

    @property
    def active(self) -> bool:
        """Still on the in-place path (chosen at start, and no reconfigure failed since)."""
        return self.path == RECONFIGURE

    def abandoned(self, work: Any = None) -> None:
        """``work`` (default: ``inflight``) was given up, maybe before it completed."""
        work = self.inflight if work is None else work
        if work is not None and self._pg is not None and not work.is_completed():
            self._stale.append(work)

    def handle(self) -> str | None:
        """This worker's handle for the next epoch (None: off the in-place path)."""
        if not self.active:
            return None
        try:
            if self._pg is None or not all(w.is_completed() for w in self._stale):
                self._renew()
            return str(self._pg.get_reconfigure_handle())
        except RuntimeError as exc:
            self._fail(f"no reconfigurable group: {exc}")
            return None

    def _renew(self) -> None:
        if self._pg is not None:
            leak(self._pg)
        store = dist.PrefixStore(self._namespace, self._raw())
        ident = int(store.add("ids", 1))  # (the handle names the group by it: unique per job)
        self._pg = dist.ProcessGroupGloo(  # type: ignore[call-arg]  # (torch >= 2.14)
            store, ident, 1, timeout=timedelta(seconds=self.timeout_s), enable_reconfigure=True
        )
        self._stale = []

    def form(
        self, number: int, handles: Sequence[str | None], superseded: Callable[[], bool]
    ) -> Any:
        """Re-form the group around ``handles`` (rank = position) for epoch ``number`` and
        return it; None (make a fresh group) unless every member posted a handle and this
        worker is on the in-place path, or when the reconfigure failed (then this worker
        leaves the in-place path: ``live_group_fallback``).

        Raises:
            LiveAborted: a newer epoch superseded ``number`` meanwhile.
        """
        self.formed = FRESH
        if not (handles and self.active and all(h is not None for h in handles)):
            return None
        opts = _options()
        opts.uuid = number + 1
        opts.handles = list(handles)
        opts.timeout = timedelta(seconds=self.timeout_s)
        deadline = time.monotonic() + self.timeout_s
        next_look = 0.0
        try:
            work = self._pg.reconfigure(opts)
            while not work.is_completed():
                now = time.monotonic()
                if now >= next_look:
                    next_look = now + 0.005
                    if superseded():
                        self.abandoned(work)
                        raise LiveAborted(f"epoch {number} superseded while re-forming")
                if now > deadline:
                    raise TimeoutError(f"no completion in {self.timeout_s:g}s")
                time.sleep(0.0005)
            work.wait()
        except (RuntimeError, TimeoutError) as exc:
            self._fail(str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__)
            return None
        self.formed = RECONFIGURE
        return self._pg

    def _fail(self, error: str) -> None:
        log.warning("in-place group re-forming failed (%s); fresh groups from now on", error)
        self._emit("live_group_fallback", error=error, group_path=FRESH)
        self.path = FRESH
        if self._pg is not None:
            leak(self._pg)
        self._pg = None
        self._stale = []


__all__ = ["FRESH", "RECONFIGURE", "InPlaceGroups", "unsupported_reason"]
