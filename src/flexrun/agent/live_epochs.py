"""Live mode, the agent's store side: this node's member list and the job's epoch record.

Owns every store access of an agent in live mode, through the records of
:mod:`flexrun.live_protocol`: publishing which of this node's workers are included,
publishing the next membership epoch (by compare-and-set: every agent of a round computes
the same list, the first writer wins; an agent still in an older round than the epoch's
leaves it alone, or two agents whose rounds differ would replace each other's epoch every
few milliseconds until the older one caught up) and telling whether any living worker can still hold the
current epoch's state. The processes themselves are :mod:`flexrun.agent.live`'s.

A restarted store has lost these records. Each node notices its own record missing and
writes it again; once every node of the round has, the epoch is published again, numbered
above the newest one this node saw (so no worker mistakes it for an old one, and members
whose agreement the restart interrupted move on to it), together with ``formed``.
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
        self._known: EpochRecord | None = None
        """The newest epoch this node has seen (survives a store restart)."""
        self._formed_seen = False

    def forget(self) -> None:
        """Publish again at the next call (after this node's workers were stopped)."""
        self._published = None

    def current(self) -> EpochRecord | None:
        """The job's current epoch (None: none yet, or unreadable).

        Raises:
            StoreUnavailable: the store cannot be reached.
        """
        rec = self._note(_decode(self.store.get(self.keys.epoch)))
        return rec if rec is not None else self._known

    def formed(self) -> bool:
        """Some epoch of this job has trained (a worker once held state)."""
        if not self._formed_seen:
            self._formed_seen = self.store.get(self.keys.formed) is not None
        return self._formed_seen

    def _note(self, rec: EpochRecord | None) -> EpochRecord | None:
        if rec is not None and (self._known is None or rec.number >= self._known.number):
            self._known = rec
        return rec

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
        records = self._node_workers()
        if self._published != own or records.get(self.node_id) != own[1]:
            # (Missing although published: the store restarted and lost it.)
            self.store.put(self.keys.node(self.node_id), NodeWorkers(*own).encode())
            self._published = own
            records[self.node_id] = own[1]
        members = [w for m in rnd.members for w in records.get(m.node_id, ())]
        entry = self.store.get(self.keys.epoch)
        current = self._note(_decode(entry))
        if current is not None and current.round > rnd.number:
            return  # (published from a newer round than this node's: its round follows)
        if current is None and self._known is not None:
            rec = self._restored(rnd, records, members)
        else:
            rec = next_epoch(current, members, rnd.number)
            if not self._formed_seen and current is not None:
                self.formed()
        if rec is None:
            return
        ok, _ = self.store.compare_and_set(
            self.keys.epoch, rec.encode(), expected_revision=entry.revision if entry else 0
        )
        if ok:
            self._note(rec)
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

    def _restored(
        self, rnd: RoundRecord, records: dict[str, tuple[str, ...]], members: list[str]
    ) -> EpochRecord | None:
        """The epoch to publish on a store that lost it (None: wait until every node of
        the round has written its record again, or a new round leaves a lost node out)."""
        known = self._known
        assert known is not None
        if any(m.node_id not in records for m in rnd.members) or not members:
            return None
        if self._formed_seen:
            self.store.put(self.keys.formed, str(known.number).encode())
        rec = next_epoch(known, members, rnd.number) or EpochRecord(
            known.number + 1, known.members, False, rnd.number
        )
        log.warning(
            "the store lost the live epoch (restarted?): publishing epoch %d again as %d",
            known.number,
            rec.number,
        )
        self.events.emit("live_epoch_restored", epoch=rec.number, previous=known.number)
        return rec


def _decode(entry: Entry | None) -> EpochRecord | None:
    if entry is None:
        return None
    try:
        return EpochRecord.decode(entry.value)
    except ValueError as exc:
        log.warning("ignoring an unreadable live epoch record: %s", exc)
        return None
