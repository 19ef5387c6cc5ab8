"""Who watches membership: reading the watcher claim, judging its holder, taking it over.

Owns the claim key's bookkeeping for one handler (:class:`Claims`): when to read it (as
the watcher every step; as a follower when the header changed within a round, and every
``max(heartbeat_interval, heartbeat_timeout / 2)``, ten times less often outside the first
group ranks: :func:`flexrun.rendezvous.follow.claim_check_interval`), the holder's keep-alive (on that
periodic check, or when the holder changed; a periodic check that finds the round directory
unchanged since the last read reads the keep-alive alone: :meth:`Claims.quiet_check`), claiming by
compare-and-set when :func:`flexrun.rendezvous.follow.should_claim` says so, and handing
the role over on a graceful leave.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

from flexrun.errors import RendezvousError
from flexrun.rendezvous.follow import claim_check_interval, should_claim
from flexrun.rendezvous.state import RUNNING, Claim, RoundRecord
from flexrun.store.api import local_expiry

if TYPE_CHECKING:
    from flexrun.rendezvous.session import Session

log = logging.getLogger("flexrun.rendezvous")


class Claims:
    """The watcher claim as one node sees it."""

    def __init__(self, s: Session) -> None:
        self.s = s
        self.claim: Claim | None = None
        self.rev = 0
        self.was_watcher = False
        self._last = float("-inf")  # when the claim was last read on the periodic check
        self._seen_at = -1  # header revision when the claim was last read
        self._seen_number = -1  # and that header's round number
        self._vacant_since: float | None = None
        self._unranked_checks = 0  # periodic checks since this node last had a rank
        self._expiry: float | None = None  # when the holder's keep-alive expires as judged here

    @property
    def watching(self) -> bool:
        """Whether this node holds the watcher claim (kept in the session: its copy of the
        round directory is not read while it watches)."""
        return self.s.watching

    @watching.setter
    def watching(self, value: bool) -> None:
        self.s.watching = value

    def interval(self) -> float:
        """The periodic check's interval for this node now (its rank in the running round
        decides: :func:`claim_check_interval`)."""
        st = self.s.settings
        r = self.s.round
        mine = r.mine if r is not None and r.state == RUNNING else None
        rank = mine.group_rank if mine is not None and mine.member else None
        base = max(st.heartbeat_interval_s, st.heartbeat_timeout_s / 2)
        return claim_check_interval(base, rank, self._unranked_checks, deputy_s=self._deputy_s())

    def _deputy_s(self) -> float:
        return self.s.settings.heartbeat_interval_s / 2

    def held_elsewhere(self) -> bool:
        """Another node holds the watcher claim (as last read)."""
        c = self.claim
        return c is not None and c.node not in ("", self.s.me.node_id)

    def due(self, now: float) -> bool:
        # From the last check, at the interval of the node's current rank: a node that
        # just became a deputy is due at once if its last check is older than that. A
        # deputy is also due the moment the holder's keep-alive, as last read, expires.
        interval = self.interval()
        if now >= self._last + interval:
            return True
        return interval <= self._deputy_s() and self._expiry is not None and now >= self._expiry

    def _judged_alive(self, key: str) -> None:
        """The holder's keep-alive ``key`` was just read alive: note when it would expire
        (where the store says: tcp judges it by this client's clock)."""
        self._expiry = local_expiry(self.s.store, key)

    def _checked_at(self, now: float) -> None:
        self._last = now
        r = self.s.round
        ranked = r is not None and r.state == RUNNING and r.mine is not None and r.mine.member
        self._unranked_checks = 0 if ranked else self._unranked_checks + 1

    def quiet_check(self, now: float) -> bool:
        """The periodic check when nothing under the round directory changed since this
        node last read it (its watch says so): the claim is as last read, so only the
        holder's keep-alive is read. True: the holder is alive, the check is done. False:
        the claim is vacant or its holder looks dead; :meth:`update` reads the claim again
        before judging (a full check reads the header and the claim besides: on the tcp
        store 7 requests where this is 2, and a formation of 4096 nodes cost each node 3)."""
        s = self.s
        claim = self.claim
        if claim is None or not self.held_elsewhere():
            return False
        key = s.keys.heartbeat(claim.node)
        if s.store.get(key) is None:
            return False
        self._judged_alive(key)
        self._checked_at(now)
        return True

    def update(self, hdr: RoundRecord | None, hdr_rev: int, now: float) -> None:
        """Read the claim when due (always as the watcher; after the header changed: a new
        watcher proposes, a leaving one touches the header), judge the holder's keep-alive,
        and claim the role when :func:`should_claim` says so."""
        s = self.s
        number = hdr.number if hdr is not None else -1
        # A header rewritten within one round (a touch by a leaving watcher, a failure
        # report, closing) may mean a vacated claim; a new round was proposed by a live
        # watcher, so its publication costs the followers no claim read.
        touched = hdr_rev != self._seen_at and number == self._seen_number
        self._seen_at, self._seen_number = hdr_rev, number
        periodic = self.due(now)
        if not (self.watching or self.claim is None or hdr is None or touched or periodic):
            return
        if periodic:
            self._checked_at(now)
        entry = s.read_round_key(s.keys.watcher)
        claim: Claim | None = None
        if entry is not None:
            try:
                claim = Claim.decode(entry.value)
            except RendezvousError as exc:
                s.rejected(s.keys.watcher, f"corrupt: {exc}"[:200])
        rev = entry.revision if entry is not None else 0
        alive: bool | None = None
        holder = self.claim.node if self.claim is not None else None
        if (
            claim is not None
            and claim.node
            and claim.node != s.me.node_id
            and (periodic or claim.node != holder)
        ):
            # The holder's keep-alive: on the periodic check (what bounds the fallback),
            # or when the holder is new to this node; not at every header change (a
            # round's publication would cost every follower a second read).
            key = s.keys.heartbeat(claim.node)
            alive = s.store.get(key) is not None
            if alive:
                self._judged_alive(key)
            else:
                self._expiry = None
        if claim is None:
            self._vacant_since = now if self._vacant_since is None else self._vacant_since
        else:
            self._vacant_since = None
        if not s.stopped and should_claim(
            claim,
            alive,
            me=s.me.node_id,
            was_watcher=self.was_watcher,
            seen_rounds=s.floor > 0,
            vacant_for_s=now - (self._vacant_since or now),
            settle_s=s.settings.heartbeat_timeout_s,
        ):
            new = Claim(s.me.node_id, (claim.term if claim is not None else 0) + 1)
            ok, won = s.store.compare_and_set(s.keys.watcher, new.encode(), expected_revision=rev)
            if ok and won is not None:
                previous = claim.node if claim is not None else ""
                claim, rev = new, won.revision
                s.events.emit("watcher_claimed", term=new.term, previous=previous or None)
                log.info("this node watches membership now (term %d)", new.term)
            else:
                claim = None
                self._last = float("-inf")  # lost the race: read who won next time
        was = self.watching
        self.claim, self.rev = claim, rev
        self.watching = claim is not None and claim.node == s.me.node_id
        if was and not self.watching:
            log.warning("another node watches membership now: following")
        self.was_watcher = self.was_watcher or self.watching

    def hand_over(self) -> None:
        """Give the watcher role up (a graceful leave): vacate the claim, then touch the
        header so that the followers, which read the claim when the header changes, take
        the role over at once instead of at their next periodic check."""
        s, claim = self.s, self.claim
        if claim is None:
            return
        vacant = Claim("", claim.term + 1)
        ok, _ = s.store.compare_and_set(s.keys.watcher, vacant.encode(), expected_revision=self.rev)
        hdr, rev = s.read_header()
        if ok and hdr is not None:
            touched = dataclasses.replace(hdr, seq=s.max_seq + 1)
            if s.store.compare_and_set(s.keys.round, touched.header(), expected_revision=rev)[0]:
                s.note_header(touched)
        self.watching = False


__all__ = ["Claims"]
