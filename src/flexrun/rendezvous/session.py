"""One node's rendezvous session: the state its roles share, and the reads and writes on it.

Owns what the watcher (:mod:`flexrun.rendezvous.watcher`), the claims
(:mod:`flexrun.rendezvous.claims`), the follower (:mod:`flexrun.rendezvous.follower`) and
the master addresses (:mod:`flexrun.rendezvous.masters`) all need: the store and the job's
keys, this node's record, the clock and settings, what has been seen of the round header
(the newest number and write sequence, the floor new rounds are numbered above, the round
this node knows and runs), whether this node watches, the round directory's copy
(:class:`~flexrun.rendezvous.changewatch.ChangeWatch`), and the header reads and the
registration every role performs. It does not sequence the roles (the handler,
:mod:`flexrun.rendezvous.handler`, does) and does not decide.
"""

from __future__ import annotations

import logging
import threading

from flexrun._clock import Clock
from flexrun.config import RendezvousSettings
from flexrun.errors import RendezvousError
from flexrun.events import EventLog
from flexrun.rendezvous.changewatch import ChangeWatch
from flexrun.rendezvous.state import Keys, MasterRecord, NodeRecord, RoundRecord
from flexrun.store.api import Entry, Store, judges_ttl_locally
from flexrun.store.rejects import Rejects

log = logging.getLogger("flexrun.rendezvous")


class Session:
    """The shared state of one node's rendezvous of one job."""

    def __init__(
        self,
        store: Store,
        *,
        run_id: str,
        me: NodeRecord,
        settings: RendezvousSettings,
        events: EventLog,
        clock: Clock,
    ) -> None:
        self.store = store
        self.keys = Keys(run_id)
        self.me = me
        self.me_raw = me.encode()
        self.settings = settings
        self.events = events
        self.clock = clock
        self.round: RoundRecord | None = None
        self.known_round: RoundRecord | None = None
        self.floor = 0  # the highest round number seen: new rounds are numbered above it
        self.max_seq = 0  # the highest header write sequence seen
        self.newest = (0, 0)  # (number, seq) of the newest header seen: older ones are replays
        self.header: RoundRecord | None = None
        self.replayed = False
        self.settle_until = 0.0
        self.high_rev = 0  # the newest header revision this node read or wrote
        self.watching = False  # this node holds the watcher claim (set by the claims)
        self.master: tuple[int, MasterRecord] | None = None  # the last master address seen
        self.judges_ttl = judges_ttl_locally(store)
        self.joined_at = clock.monotonic()
        self.stop = threading.Event()
        self.changes = ChangeWatch(store, self.stop)
        self._rejects = Rejects("ignored a rendezvous record", sink=self.emit_rejected, clock=clock)

    @property
    def stopped(self) -> bool:
        return self.stop.is_set()

    def rejected(self, key: str, reason: str) -> None:
        """A record this node ignored: logged and reported at a bounded rate (a stranger
        rewriting a key in a loop must not flood the event log)."""
        self._rejects.report(key, reason)

    def emit_rejected(self, key: str, reason: str) -> None:
        self.events.emit("store_record_rejected", key=key, reason=reason)

    # -- registration ------------------------------------------------------------------------
    def beat(self) -> None:
        # The keep-alive carries the node record: a store that lost the record (restarted)
        # still knows the node from its next beat.
        self.store.put(
            self.keys.heartbeat(self.me.node_id),
            self.me_raw,
            ttl_s=self.settings.heartbeat_timeout_s,
        )

    def reregister(self, now: float) -> None:
        """The store lost this node's record (it restarted): register again."""
        self.store.put(self.keys.node(self.me.node_id), self.me.encode())
        self.beat()
        self.settle_until = now + self.settings.heartbeat_timeout_s
        self.joined_at = now  # the join timeout counts from this (re)join
        self.events.emit("store_rejoined", node_id=self.me.node_id)
        log.warning("the store lost this node's record (restarted?): registered again")

    # -- the round header --------------------------------------------------------------------
    def read_header(self) -> tuple[RoundRecord | None, int]:
        """The current header and its revision. An older header than this node has seen
        (a replay) is rejected: the newest seen stands in for it (``replayed`` is set)."""
        return self.header_of(self.store.get(self.keys.round))

    def header_of(self, entry: Entry | None) -> tuple[RoundRecord | None, int]:
        self.replayed = False
        if entry is None:
            return None, 0
        try:
            rnd = RoundRecord.decode(entry.value)
        except RendezvousError as exc:
            self.rejected(self.keys.round, f"corrupt: {exc}"[:200])
            return self.header, entry.revision
        if (rnd.number, rnd.seq) < self.newest:
            self.replayed = True
            self.rejected(
                self.keys.round,
                f"round {rnd.number} is older than round {self.newest[0]} (replayed)",
            )
            return self.header, entry.revision
        self.note_header(rnd)
        self.high_rev = max(self.high_rev, entry.revision)
        return rnd, entry.revision

    def note_header(self, rnd: RoundRecord) -> None:
        self.newest = max(self.newest, (rnd.number, rnd.seq))
        self.floor = max(self.floor, rnd.number)
        self.max_seq = max(self.max_seq, rnd.seq)
        if self.header is None or (rnd.number, rnd.seq) >= (self.header.number, self.header.seq):
            self.header = rnd

    def set_round(self, rnd: RoundRecord | None) -> None:
        self.round = rnd
        if rnd is not None:
            self.known_round = rnd

    def round_restored(self, rnd: RoundRecord) -> None:
        """This node put round ``rnd`` back (the store lost it): settle, and publish the
        round's master address again (a member still waiting for it would wait for ever)."""
        self.settle_until = self.clock.monotonic() + self.settings.heartbeat_timeout_s
        self.events.emit("round_restored", round=rnd.number)
        if self.master is not None and self.master[0] == rnd.number:
            self.store.compare_and_set(
                self.keys.master(rnd.number), self.master[1].encode(), expected_revision=0
            )

    # -- the round directory's copy ----------------------------------------------------------
    def read_round_key(self, key: str) -> Entry | None:
        """A key of the round directory (the claim, a master address): from the local copy
        a follower keeps of it where the store allows (:mod:`flexrun.rendezvous.changewatch`),
        else from the store. Not for a value to compare-and-set on at once: the copy may
        lag the store by a watch delivery (a lost compare-and-set reads it again)."""
        copied = self.copied(key)
        return copied[0] if copied is not None else self.store.get(key)

    def copied(self, key: str) -> tuple[Entry | None, int] | None:
        """``key`` from the copy, unless this node watches, or has read or written a header
        newer than the copy has caught up with (it would take its own header write for a
        replay). (A direct read's store revision does not count: the store's revision runs
        ahead of a quiet round directory, and the copy would never be read again.)"""
        copied = None if self.watching else self.changes.read(key)
        return copied if copied is not None and copied[1] >= self.high_rev else None


__all__ = ["Session"]
