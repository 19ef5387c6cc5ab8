"""Live mode, the agent's store side: this node's member list and the job's epoch record.

Owns every store access of an agent in live mode, through the records of
:mod:`flexrun.live_protocol`: publishing which of this node's workers are included,
publishing the next membership epoch (by compare-and-set: every agent computes the same
list, the first writer wins) and telling whether any living worker can still hold the
current epoch's state. The processes themselves are :mod:`flexrun.agent.live`'s.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from flexrun.events import EventLog
from flexrun.live_protocol import EpochRecord, LiveKeys, NodeWorkers, next_epoch
from flexrun.rendezvous.state import RoundRecord
from flexrun.store.api import Entry, Store

log = logging.getLogger("flexrun.agent")


class EpochPublisher:
    """One node's writes (and the reads they need) of the live-mode records."""

    def __init__(self, store: Store, *, run_id: str, node_id: str, events: EventLog) -> None:
        self.store = store
        self.keys = LiveKeys(run_id)
        self.node_id = node_id
        self.events = events
        self._published: tuple[int, tuple[str, ...]] | None = None

    def forget(self) -> None:
        """Publish again at the next call (after this node's workers were stopped)."""
        self._published = None

    def current(self) -> EpochRecord | None:
        """The job's current epoch (None: none yet, or unreadable).

        Raises:
            StoreUnavailable: the store cannot be reached.
        """
        return _decode(self.store.get(self.keys.epoch))

    def formed(self) -> bool:
        """Some epoch of this job has trained (a worker once held state)."""
        return self.store.get(self.keys.formed) is not None

    def _node_workers(self) -> dict[str, tuple[str, ...]]:
        out = {}
        for key, entry in self.store.get_prefix(self.keys.nodes).items():
            try:
                out[key[len(self.keys.nodes) :]] = NodeWorkers.decode(entry.value).workers
            except ValueError as exc:
                log.warning("ignoring an unreadable live node record %s: %s", key, exc)
        return out

    def others_hold(self, rnd: RoundRecord | None, current: EpochRecord) -> bool:
        """Another node of ``rnd`` has published workers that are members of ``current``
        (they may hold its state: they fall back themselves if they turn out not to)."""
        records = self._node_workers()
        for m in rnd.members if rnd is not None else ():
            if m.node_id != self.node_id and set(records.get(m.node_id, ())) & set(current.members):
                return True
        return False

    def publish(self, rnd: RoundRecord, mine: Sequence[str]) -> None:
        """Publish this node's included workers ``mine`` and, if the job's list (the
        included workers of ``rnd``'s nodes, in node order) changed, the next epoch.

        Raises:
            StoreUnavailable: the store cannot be reached.
        """
        own = (rnd.number, tuple(mine))
        if self._published != own:
            self.store.put(self.keys.node(self.node_id), NodeWorkers(*own).encode())
            self._published = own
        records = self._node_workers()
        members = [w for m in rnd.members for w in records.get(m.node_id, ())]
        entry = self.store.get(self.keys.epoch)
        rec = next_epoch(_decode(entry), members)
        if rec is None:
            return
        ok, _ = self.store.compare_and_set(
            self.keys.epoch, rec.encode(), expected_revision=entry.revision if entry else 0
        )
        if ok:
            self.events.emit(
                "live_epoch",
                epoch=rec.number,
                members=list(rec.members),
                abort=rec.abort,
                world_size=len(rec.members),
            )
            log.info(
                "live epoch %d: %d worker(s)%s",
                rec.number,
                len(rec.members),
                " (abort)" if rec.abort else "",
            )


def _decode(entry: Entry | None) -> EpochRecord | None:
    if entry is None:
        return None
    try:
        return EpochRecord.decode(entry.value)
    except ValueError as exc:
        log.warning("ignoring an unreadable live epoch record: %s", exc)
        return None
