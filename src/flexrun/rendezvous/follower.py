"""A follower's reads: the round header's own slice, and putting a lost round back.

Owns what a node that does not watch membership reads and remembers (:class:`Follower`):
its slice of each member list (read once per list; asked of the watcher when missing),
and, when the store lost the round (it restarted), registering again and restoring the
round it trains in. The decisions are :func:`flexrun.rendezvous.follow.follow`'s.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from flexrun.rendezvous.decide import Action
from flexrun.rendezvous.follow import FollowView, follow
from flexrun.rendezvous.records import ask_for_slice, read_slice
from flexrun.rendezvous.state import RUNNING, RoundRecord, Slice, carried_slice, with_loader

if TYPE_CHECKING:
    from flexrun.rendezvous.session import Session

SLICES_KEPT = 4


def member(r: RoundRecord | None) -> bool | None:
    """What ``r``'s slice says of its reader (None: no slice read)."""
    return r.mine.member if r is not None and r.mine is not None else None


class Follower:
    """The follower role of one handler."""

    def __init__(self, s: Session) -> None:
        self.s = s
        self.slices: dict[str, Slice] = {}
        self._asked = ""

    def settled(self, held_elsewhere: bool) -> bool:
        """Nothing but a change of what it watches can change this node's decision now:
        its round is settled, or no round exists yet while another node holds the watcher
        claim (``held_elsewhere``; the holder's keep-alive is checked when
        :meth:`flexrun.rendezvous.claims.Claims.due`). Not so once
        rounds were seen (``floor``): a missing header then means the store lost it, and
        restoring it needs a read."""
        s = self.s
        r = s.round
        if r is None:
            return s.floor == 0 and held_elsewhere
        return r.state != RUNNING or member(r) is not None

    def again(self, running: int | None) -> Action:
        """The decision from what was read last (nothing changed since)."""
        s = self.s
        return follow(FollowView(s.me.node_id, s.round, member(s.round), running))

    def step(self, running: int | None, hdr: RoundRecord | None, now: float) -> Action:
        s = self.s
        if hdr is None and s.floor > 0:
            self.store_lost(running, now)
            hdr, _ = s.read_header()
        cur = self.attach(hdr)
        s.set_round(cur)
        return follow(FollowView(s.me.node_id, cur, member(cur), running))

    def with_slice(self, rnd: RoundRecord) -> RoundRecord:
        s = self.s
        return dataclasses.replace(
            with_loader(s.store, s.keys, rnd), mine=self.slices.get(rnd.digest)
        )

    def attach(self, hdr: RoundRecord | None) -> RoundRecord | None:
        """``hdr`` with this node's slice (read once per member list) and its member list
        readable on use; asks the watcher once for a slice that is not there."""
        if hdr is None:
            return None
        s = self.s
        rnd = with_loader(s.store, s.keys, hdr)
        digest = rnd.digest
        mine = self.slices.get(digest) if digest else None
        if digest and mine is None and rnd.state == RUNNING:
            old = self.slices.get(rnd.prev) if rnd.prev else None
            carried = carried_slice(old, rnd) if old is not None else None
            # (a member the new list kept in place needs no read: a scale-up costs the
            # members already there nothing)
            mine = carried or read_slice(s.store, s.keys, digest, s.me.node_id)
            if mine is not None:
                self.slices[digest] = mine
                while len(self.slices) > SLICES_KEPT:
                    del self.slices[next(iter(self.slices))]
            elif self._asked != digest:
                ask_for_slice(s.store, s.keys, s.me.node_id, digest)
                self._asked = digest
        return dataclasses.replace(rnd, mine=mine)

    def store_lost(self, running: int | None, now: float) -> None:
        """The header is gone although rounds were seen: the store restarted. Register
        again if the record went too, and put back the round this node trains in."""
        s = self.s
        if not s.stopped and s.store.get(s.keys.node(s.me.node_id)) is None:
            s.reregister(now)
        known = s.known_round
        if running is not None and known is not None:
            ok, _ = s.store.compare_and_set(s.keys.round, known.header(), expected_revision=0)
            if ok:
                s.round_restored(known)


__all__ = ["Follower", "member"]
