"""The watcher: the one node that reads membership and proposes rounds.

Owns what only the watcher does: reading every node record and keep-alive (incremental
reads: a repeated ``get_prefix`` transfers what changed), the bookkeeping the pure
decisions need (when the alive set last changed, whose keep-alive was seen renewed),
proposing (member list and slices first, then one compare-and-set of the small header),
answering nodes that found no slice, removing superseded member lists, and putting the
round back after a store restart. The decisions are :func:`flexrun.rendezvous.decide`'s.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

from flexrun.errors import RendezvousError
from flexrun.rendezvous.decide import Action, Propose, View, Wait, decide, next_round
from flexrun.rendezvous.records import (
    asked_digest,
    read_members,
    write_members,
    write_slice,
)
from flexrun.rendezvous.state import (
    PENDING,
    RUNNING,
    Member,
    Members,
    NodeRecord,
    RoundRecord,
    Slice,
    kept_of,
    slices_of,
)
from flexrun.rendezvous.static import decide_static, static_members
from flexrun.store.api import Entry

if TYPE_CHECKING:
    from flexrun.rendezvous.session import Session

log = logging.getLogger("flexrun.rendezvous")

LISTS_KEPT = 4  # member lists the watcher keeps in memory (current, previous, proposals)


class Watcher:
    """The watcher role of one handler (state kept across steps while it holds it)."""

    def __init__(self, s: Session) -> None:
        self.s = s
        self.lists: dict[str, tuple[Member, ...]] = {}
        self.alive_set: frozenset[str] = frozenset()
        self.candidates_since = s.clock.monotonic()
        # Keep-alives seen: node -> (first revision seen, seen renewed since). Only where
        # readers judge TTLs themselves (tcp): see View.unconfirmed.
        self.beats_seen: dict[str, tuple[int, bool]] = {}
        # (store revision, monotonic time) read just before this watcher's previous step:
        # a keep-alive first seen with a higher revision was written since (fresh).
        self.last_read: tuple[int, float] | None = None

    # -- reading ----------------------------------------------------------------------------
    def members(self, hdr: RoundRecord) -> RoundRecord | None:
        """``hdr`` with its member list in memory; None if the list cannot be read."""
        m = hdr.members
        if not isinstance(m, Members) or m.loaded:
            return hdr
        known = self.lists.get(m.digest)
        if known is None:
            try:
                known = read_members(self.s.store, self.s.keys, m.digest, len(m))
            except RendezvousError as exc:
                log.warning("round %d: %s", hdr.number, exc)
                return None
            self._keep(m.digest, known)
        elif not self._stored(m.digest):
            # A restarted store, and a follower put the header back without the list (it
            # only knows its slice): every reader of the list would fail. Write it back.
            log.warning("round %d: member list missing from the store: written back", hdr.number)
            write_members(self.s.store, self.s.keys, known)
        return dataclasses.replace(hdr, members=known)

    def _stored(self, digest: str) -> bool:
        """Whether list ``digest`` is in the store (the memory of it can outlive a store
        that restarted)."""
        return self.s.store.get(self.s.keys.chunk(digest, 0)) is not None

    def _keep(self, digest: str, members: tuple[Member, ...]) -> None:
        self.lists[digest] = members
        while len(self.lists) > LISTS_KEPT:
            del self.lists[next(iter(self.lists))]

    def _alive(
        self, nodes: dict[str, Entry], beats: dict[str, Entry], fresh_above: int | None
    ) -> dict[str, tuple[NodeRecord, int]]:
        """Nodes with a fresh keep-alive -> (record, revision at which they joined). The
        keep-alive carries the record, so a node whose record a restarted store lost is
        still seen; an agent that reads is alive whatever its own keep-alive looks like (a
        starved keep-alive thread must not make it drop itself).

        A keep-alive counts as renewed (:attr:`View.unconfirmed`) once seen with two
        revisions, or at first sight if its revision is above ``fresh_above``: written
        after this watcher's previous read, so not a dead node's old one. A newcomer is
        then taken in at the watcher's first step that sees it, not a keep-alive interval
        later."""
        s, keys = self.s, self.s.keys
        alive: dict[str, tuple[NodeRecord, int]] = {}
        for key, beat in beats.items():
            node_id = key[len(keys.heartbeats) :]
            rec = nodes.get(keys.node(node_id))
            try:
                record = NodeRecord.decode(rec.value if rec is not None else beat.value)
            except RendezvousError:
                continue
            if record.node_id == node_id:
                alive[node_id] = (record, rec.revision if rec is not None else beat.revision)
        if s.me.node_id not in alive and not s.stopped:
            mine = nodes.get(keys.node(s.me.node_id))
            alive[s.me.node_id] = (s.me, mine.revision if mine is not None else 0)
        if s.judges_ttl:
            seen = {}
            for node_id in alive:
                found = beats.get(keys.heartbeat(node_id))
                rev = found.revision if found is not None else 0
                new = node_id == s.me.node_id or (fresh_above is not None and rev > fresh_above)
                first, renewed = self.beats_seen.get(node_id, (rev, new))
                seen[node_id] = (first, renewed or rev != first)
            self.beats_seen = seen  # a node that vanishes is unconfirmed when it returns
        return alive

    # -- one step -----------------------------------------------------------------------------
    def step(
        self,
        running: int | None,
        hdr: RoundRecord | None,
        hdr_rev: int,
        *,
        read: tuple[int, float] | None = None,
    ) -> Action:
        """One watcher step; ``read``: the store revision and the time read before this
        step's reads (what a later step judges a newcomer's first keep-alive by)."""
        s, keys = self.s, self.s.keys
        nodes = s.store.get_prefix(keys.nodes)
        beats = s.store.get_prefix(keys.heartbeats)
        asks = s.store.get_prefix(keys.asks)
        now = s.clock.monotonic()
        fresh_above = fresh_since(self.last_read, now, s.settings.heartbeat_timeout_s)
        self.last_read = read
        if keys.node(s.me.node_id) not in nodes and not s.stopped:
            s.reregister(now)  # the store lost our record (it restarted)
        if hdr is None and s.floor > 0:
            if running is not None and s.known_round is not None:
                hdr, hdr_rev = self.restore(s.known_round)
        elif hdr is not None and s.replayed and s.known_round is not None:
            hdr, hdr_rev = self.rewrite(s.known_round, hdr_rev)
        cur = self.members(hdr) if hdr is not None else None
        unreadable = hdr is not None and cur is None
        if cur is None and hdr is not None:
            cur = dataclasses.replace(hdr, members=())
        alive = self._alive(nodes, beats, fresh_above)
        registered = frozenset(k[len(keys.nodes) :] for k in nodes)
        if frozenset(alive) != self.alive_set:
            self.alive_set = frozenset(alive)
            self.candidates_since = now
        view = View(
            me=s.me.node_id,
            round=cur,
            alive=alive,
            registered=registered,
            running=running,
            now=now,
            candidates_since=self.candidates_since,
            settle_until=s.settle_until,
            floor=s.floor,
            unconfirmed=frozenset(n for n, (_, renewed) in self.beats_seen.items() if not renewed),
        )
        action = (decide_static if s.settings.static else decide)(view, s.settings)
        if unreadable and cur is not None and cur.state == RUNNING:
            rec = next_round(None, alive, s.settings, "round_repaired", floor=s.floor)
            if s.settings.static:
                world = static_members(alive, s.settings.max_nodes)
                rec = dataclasses.replace(
                    rec, members=world or (), state=RUNNING if world else PENDING
                )
            action = Propose(rec, cur.number, joined=tuple(rec.member_ids))
        if asks:
            self.answer(asks, cur)
        s.set_round(cur)
        if isinstance(action, Propose):
            self.propose(action, cur, hdr_rev)
            return Wait("proposed a new round")
        return action

    # -- writing ------------------------------------------------------------------------------
    def propose(self, p: Propose, cur: RoundRecord | None, cur_rev: int) -> bool:
        """Write the proposal's member list (unless known), then compare-and-set the header."""
        s = self.s
        rec = p.record
        prev, kept = (cur.prev, cur.kept) if cur is not None else ("", 0)
        if cur is not None and cur.digest and cur.digest != rec.digest:
            prev = cur.digest
            known = isinstance(cur.members, tuple)  # (in memory: the list was readable)
            kept = kept_of(cur.members, rec.members) if known and rec.members else 0
        rec = dataclasses.replace(rec, seq=s.max_seq + 1, prev=prev, kept=kept)
        digest = rec.digest
        wrote = False
        if rec.members and (digest not in self.lists or not self._stored(digest)):
            write_members(s.store, s.keys, rec.members)
            self._keep(digest, tuple(rec.members))
            wrote = True
        ok, _ = s.store.compare_and_set(s.keys.round, rec.header(), expected_revision=cur_rev)
        if not ok:
            if wrote:
                winner, _ = s.read_header()
                if winner is None or winner.digest != digest:
                    s.store.delete_prefix(s.keys.members_of(digest))  # our orphaned list
                    self.lists.pop(digest, None)
            return False
        s.note_header(rec)
        for n in p.lost:
            s.events.emit("node_lost", node_id=n, round=rec.number)
            s.store.delete(s.keys.node(n))  # (a node that comes back is seen by its keep-alive)
        for n in p.left:
            s.events.emit("node_left", node_id=n, round=rec.number)
        if rec.reason == "scale_up":
            s.events.emit(
                "scale_up", round=rec.number, joined=list(p.joined), nodes=len(rec.members)
            )
        elif rec.reason in ("node_lost", "node_left"):
            s.events.emit("scale_down", round=rec.number, nodes=len(rec.members))
        if cur is not None and cur.digest != digest and cur.prev not in ("", digest, cur.digest):
            s.store.delete_prefix(s.keys.members_of(cur.prev))  # two lists back: nobody reads it
            self.lists.pop(cur.prev, None)
        log.info(
            "round %d proposed (%s): %d node(s) %s",
            rec.number,
            rec.reason,
            len(rec.members),
            rec.member_ids[:8] if rec.members else rec.state,
        )
        return True

    def answer(self, asks: dict[str, Entry], cur: RoundRecord | None) -> None:
        """Write the slice each asking node did not find (or that it is not a member)."""
        s, keys = self.s, self.s.keys
        mine = {sl.node_id: sl for sl in slices_of(cur.members)} if cur is not None else {}
        for key, entry in asks.items():
            node_id = key[len(keys.asks) :]
            want = asked_digest(entry.value)
            if cur is not None and want and want == cur.digest:
                write_slice(s.store, keys, mine.get(node_id) or Slice(want, node_id, False))
            s.store.delete(key)

    def restore(self, known: RoundRecord) -> tuple[RoundRecord | None, int]:
        """The store lost the round this node runs: put it (and its list) back."""
        s = self.s
        full = self.members(known)
        if full is not None and full.members:
            write_members(s.store, s.keys, full.members)
        ok, entry = s.store.compare_and_set(s.keys.round, known.header(), expected_revision=0)
        if ok:
            s.round_restored(known)
        return s.read_header()

    def rewrite(self, known: RoundRecord, rev: int) -> tuple[RoundRecord | None, int]:
        """An older round than seen was written over the current one (a replay): write the
        current one back above it."""
        s = self.s
        rec = dataclasses.replace(known, seq=s.max_seq + 1)
        ok, _ = s.store.compare_and_set(s.keys.round, rec.header(), expected_revision=rev)
        if ok:
            s.note_header(rec)
            log.warning("round %d written back over an older (replayed) round record", rec.number)
        return s.read_header()


__all__ = ["Watcher"]


def fresh_since(last_read: tuple[int, float] | None, now: float, timeout_s: float) -> int | None:
    """The revision above which a keep-alive seen for the first time is known fresh: the
    one read before the watcher's previous step, if that was under ``timeout_s`` ago (a
    write with a higher revision came after it). None: no such read (this node's first
    step as the watcher, or a long gap), and first sight proves nothing."""
    if last_read is None:
        return None
    rev, at = last_read
    return rev if now - at < timeout_s else None
