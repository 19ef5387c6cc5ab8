"""Carries out rendezvous decisions against a store: join, keep-alive, follow, close.

Owns every store access of a node's rendezvous outside the watcher role
(:mod:`flexrun.rendezvous.watcher`): reading the round header (and rejecting an older
one than seen), its own slice, who the watcher is and whether it lives, claiming the
watcher role, the keep-alive, the per-round master address, failure reports and closing.
It does not decide (``decide.py``, ``follow.py``) and does not touch processes.

Cost per node and round, at any N: a follower reads the header and its slice (and, every
``max(heartbeat_interval, heartbeat_timeout / 2)``, the watcher's claim and keep-alive);
it never reads the member list, node records or other keep-alives. A failure report,
closing the job and counting a live failure rewrite the header alone (the member list and
its slices are reused), so any node may do them.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading

from flexrun._clock import SYSTEM_CLOCK, Clock
from flexrun.cause import FailureCause
from flexrun.config import RendezvousSettings
from flexrun.errors import RendezvousError, RendezvousTimeout, StoreError
from flexrun.events import EventLog
from flexrun.rendezvous.decide import Action, Run, Wait, counted_failure, failure_round
from flexrun.rendezvous.follow import FollowView, follow, should_claim
from flexrun.rendezvous.records import ask_for_slice, read_slice, with_loader
from flexrun.rendezvous.state import (
    CLOSED,
    FAILED,
    PENDING,
    RUNNING,
    Claim,
    Keys,
    MasterRecord,
    NodeRecord,
    RoundRecord,
    Slice,
)
from flexrun.rendezvous.watcher import Watcher
from flexrun.store.api import Store
from flexrun.store.signed import is_signed, report_to

log = logging.getLogger("flexrun.rendezvous")

SLICES_KEPT = 4


def free_port(addr: str) -> int:
    """A port the OS says is free on ``addr`` now (the caller's workers bind it next)."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((addr if addr not in ("localhost",) else "127.0.0.1", 0))
        return int(s.getsockname()[1])


class RendezvousHandler:
    """One node's side of the rendezvous of one job."""

    def __init__(
        self,
        store: Store,
        *,
        run_id: str,
        me: NodeRecord,
        settings: RendezvousSettings,
        events: EventLog,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.store = store
        self.keys = Keys(run_id)
        self.me = me
        self.settings = settings
        self.events = events
        self.clock = clock
        self.round: RoundRecord | None = None
        self.known_round: RoundRecord | None = None
        self.floor = 0  # the highest round number seen: new rounds are numbered above it
        self.max_seq = 0  # the highest header write sequence seen
        self._newest = (0, 0)  # (number, seq) of the newest header seen: older ones are replays
        self._header: RoundRecord | None = None
        self.replayed = False
        self.settle_until = 0.0
        self._since_rev = 0
        self._known_master: tuple[int, MasterRecord] | None = None
        self._claim: Claim | None = None
        self._claim_rev = 0
        self.watching = False
        self._was_watcher = False
        self._watcher = Watcher(self)
        self._next_check = 0.0
        self._claim_seen_at = -1  # header revision when the claim was last read
        self._vacant_since: float | None = None
        self._slices: dict[str, Slice] = {}
        self._asked = ""
        self.judges_ttl = bool(getattr(store, "judges_ttl_locally", False))
        self._joined_at = clock.monotonic()
        self._stop = threading.Event()
        self._hb_thread: threading.Thread | None = None
        self._hb_failing = False
        report_to(store, self._rejected)

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def _rejected(self, key: str, reason: str) -> None:
        self.events.emit("store_record_rejected", key=key, reason=reason)

    # -- membership --------------------------------------------------------------------
    def join(self) -> None:
        """Announce this node and start its keep-alive."""
        self._beat()
        self.store.put(self.keys.node(self.me.node_id), self.me.encode())
        self._joined_at = self.clock.monotonic()
        self._hb_thread = threading.Thread(
            target=self._heartbeat_loop, name="flexrun-heartbeat", daemon=True
        )
        self._hb_thread.start()
        self.events.emit(
            "node_joined", node_id=self.me.node_id, addr=self.me.addr, nproc=self.me.nproc
        )
        if self.settings.max_nodes > 1 and not is_signed(self.store):
            log.warning(
                "THE RENDEZVOUS STORE IS NOT AUTHENTICATED: anyone who can reach it can join "
                "this job, change its rounds or fail it. Give every node the same job secret "
                "(--rdzv-conf secret_file=PATH or FLEXRUN_JOB_SECRET_FILE; chmod 600)."
            )
            self.events.emit("store_unauthenticated", node_id=self.me.node_id)

    def _beat(self) -> None:
        # The keep-alive carries the node record: a store that lost the record (restarted)
        # still knows the node from its next beat.
        self.store.put(
            self.keys.heartbeat(self.me.node_id),
            self.me.encode(),
            ttl_s=self.settings.heartbeat_timeout_s,
        )

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.settings.heartbeat_interval_s):
            try:
                self._beat()
                if self._hb_failing:
                    log.warning("store reachable again; keep-alive resumed")
                    self._hb_failing = False
            except StoreError as exc:
                if not self._hb_failing:
                    log.warning("keep-alive failed (will retry): %s", exc)
                    self._hb_failing = True

    def leave(self) -> None:
        """Stop the keep-alive and remove this node so the others re-form at once (a
        watcher first hands its role over). Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._hb_thread is not None:
            self._hb_thread.join(timeout=5)
        try:
            if self.watching and self._claim is not None:
                self._hand_over(self._claim)
            self.store.delete(self.keys.node(self.me.node_id))
            self.store.delete(self.keys.heartbeat(self.me.node_id))
        except StoreError as exc:
            log.warning("could not deregister from the store: %s", exc)

    def _hand_over(self, claim: Claim) -> None:
        """Give the watcher role up (a graceful leave): vacate the claim, then touch the
        header so that the followers, which read the claim when the header changes, take
        the role over at once instead of at their next periodic check."""
        vacant = Claim("", claim.term + 1)
        ok, _ = self.store.compare_and_set(
            self.keys.watcher, vacant.encode(), expected_revision=self._claim_rev
        )
        hdr, rev = self.read_header()
        if ok and hdr is not None:
            touched = dataclasses.replace(hdr, seq=self.max_seq + 1)
            if self.store.compare_and_set(self.keys.round, touched.header(), expected_revision=rev)[0]:
                self.note_header(touched)

    def reregister(self, now: float) -> None:
        """The store lost this node's record (it restarted): register again."""
        self.store.put(self.keys.node(self.me.node_id), self.me.encode())
        self._beat()
        self.settle_until = now + self.settings.heartbeat_timeout_s
        self._joined_at = now  # the join timeout counts from this (re)join
        self.events.emit("store_rejoined", node_id=self.me.node_id)
        log.warning("the store lost this node's record (restarted?): registered again")

    # -- the round header --------------------------------------------------------------
    def read_header(self) -> tuple[RoundRecord | None, int]:
        """The current header and its revision. An older header than this node has seen
        (a replay) is rejected: the newest seen stands in for it (``replayed`` is set)."""
        entry = self.store.get(self.keys.round)
        self.replayed = False
        if entry is None:
            return None, 0
        try:
            rnd = RoundRecord.decode(entry.value)
        except RendezvousError as exc:
            self._rejected(self.keys.round, f"corrupt: {exc}"[:200])
            return self._header, entry.revision
        if (rnd.number, rnd.seq) < self._newest:
            self.replayed = True
            self._rejected(self.keys.round, f"round {rnd.number} is older than round {self._newest[0]} (replayed)")
            return self._header, entry.revision
        self.note_header(rnd)
        return rnd, entry.revision

    def note_header(self, rnd: RoundRecord) -> None:
        self._newest = max(self._newest, (rnd.number, rnd.seq))
        self.floor = max(self.floor, rnd.number)
        self.max_seq = max(self.max_seq, rnd.seq)
        if self._header is None or (rnd.number, rnd.seq) >= (self._header.number, self._header.seq):
            self._header = rnd

    def set_round(self, rnd: RoundRecord | None) -> None:
        self.round = rnd
        if rnd is not None:
            self.known_round = rnd

    def round_restored(self, rnd: RoundRecord) -> None:
        self.settle_until = self.clock.monotonic() + self.settings.heartbeat_timeout_s
        self.events.emit("round_restored", round=rnd.number)
        known = rnd.number
        if self._known_master is not None and self._known_master[0] == known:
            # A member still waiting for the round's address would wait for ever.
            self.store.compare_and_set(
                self.keys.master(known), self._known_master[1].encode(), expected_revision=0
            )

    # -- deciding ------------------------------------------------------------------------
    def step(self, running: int | None) -> Action:
        """Read what this node's role needs, decide, and perform a proposal or a claim.

        Returns the decided action; a performed proposal returns ``Wait`` so the caller
        reads again (whether or not it won).
        """
        self._since_rev = self.store.revision()
        hdr, rev = self.read_header()
        now = self.clock.monotonic()
        self._update_claim(hdr, rev, now)
        if self.watching:
            action = self._watcher.step(running, hdr, rev)
        else:
            action = self._follow(running, hdr, now)
        rnd = self.round
        if (
            isinstance(action, Wait)
            and (rnd is None or rnd.state not in (CLOSED, FAILED))
            and running is None
            and (rnd is None or len(rnd.members) < self.settings.min_nodes)
            and now - self._joined_at > self.settings.join_timeout_s
        ):
            raise RendezvousTimeout(
                f"rendezvous timed out after {self.settings.join_timeout_s:g}s: --nnodes MIN is "
                f"{self.settings.min_nodes} and no round with that many nodes formed; start more "
                "nodes or lower MIN"
            )
        return action

    def _check_interval(self) -> float:
        s = self.settings
        return max(s.heartbeat_interval_s, s.heartbeat_timeout_s / 2)

    def _update_claim(self, hdr: RoundRecord | None, hdr_rev: int, now: float) -> None:
        """Who watches: read the claim when due (always as the watcher; after the header
        changed: a new watcher proposes, a leaving one touches the header), judge the
        holder's keep-alive, and claim the role when :func:`should_claim` says so."""
        changed, self._claim_seen_at = hdr_rev != self._claim_seen_at, hdr_rev
        if not (
            self.watching or self._claim is None or hdr is None or changed or now >= self._next_check
        ):
            return
        self._next_check = now + self._check_interval()
        entry = self.store.get(self.keys.watcher)
        claim: Claim | None = None
        if entry is not None:
            try:
                claim = Claim.decode(entry.value)
            except RendezvousError as exc:
                self._rejected(self.keys.watcher, f"corrupt: {exc}"[:200])
        rev = entry.revision if entry is not None else 0
        alive: bool | None = None
        if claim is not None and claim.node and claim.node != self.me.node_id:
            alive = self.store.get(self.keys.heartbeat(claim.node)) is not None
        if claim is None:
            self._vacant_since = now if self._vacant_since is None else self._vacant_since
        else:
            self._vacant_since = None
        if not self.stopped and should_claim(
            claim,
            alive,
            me=self.me.node_id,
            was_watcher=self._was_watcher,
            seen_rounds=self.floor > 0,
            vacant_for_s=now - (self._vacant_since or now),
            settle_s=self.settings.heartbeat_timeout_s,
        ):
            new = Claim(self.me.node_id, (claim.term if claim is not None else 0) + 1)
            ok, won = self.store.compare_and_set(self.keys.watcher, new.encode(), expected_revision=rev)
            if ok and won is not None:
                previous = claim.node if claim is not None else ""
                claim, rev = new, won.revision
                self.events.emit("watcher_claimed", term=new.term, previous=previous or None)
                log.info("this node watches membership now (term %d)", new.term)
            else:
                claim = None
                self._next_check = now  # lost the race: read who won next time
        was = self.watching
        self._claim, self._claim_rev = claim, rev
        self.watching = claim is not None and claim.node == self.me.node_id
        if was and not self.watching:
            log.warning("another node watches membership now: following")
        self._was_watcher = self._was_watcher or self.watching

    def _follow(self, running: int | None, hdr: RoundRecord | None, now: float) -> Action:
        if hdr is None and self.floor > 0:
            self._store_lost(running, now)
            hdr, _ = self.read_header()
        cur = self._attach(hdr)
        self.set_round(cur)
        member = cur.mine.member if cur is not None and cur.mine is not None else None
        return follow(FollowView(self.me.node_id, cur, member, running))

    def _attach(self, hdr: RoundRecord | None) -> RoundRecord | None:
        """``hdr`` with this node's slice (read once per member list) and its member list
        readable on use; asks the watcher once for a slice that is not there."""
        if hdr is None:
            return None
        rnd = with_loader(self.store, self.keys, hdr)
        digest = rnd.digest
        mine = self._slices.get(digest) if digest else None
        if digest and mine is None and rnd.state == RUNNING:
            mine = read_slice(self.store, self.keys, digest, self.me.node_id)
            if mine is not None:
                self._slices[digest] = mine
                while len(self._slices) > SLICES_KEPT:
                    del self._slices[next(iter(self._slices))]
            elif self._asked != digest:
                ask_for_slice(self.store, self.keys, self.me.node_id, digest)
                self._asked = digest
        return dataclasses.replace(rnd, mine=mine)

    def _store_lost(self, running: int | None, now: float) -> None:
        """The header is gone although rounds were seen: the store restarted. Register
        again if the record went too, and put back the round this node trains in."""
        if not self.stopped and self.store.get(self.keys.node(self.me.node_id)) is None:
            self.reregister(now)
        known = self.known_round
        if running is not None and known is not None:
            ok, _ = self.store.compare_and_set(self.keys.round, known.header(), expected_revision=0)
            if ok:
                self.round_restored(known)

    # -- waiting ------------------------------------------------------------------------
    def watched_prefix(self) -> str:
        """What :meth:`wait` waits on: the watcher all of ``s/``, the others the round."""
        return self.keys.watched if self.watching else self.keys.round_dir

    def wait(self, timeout_s: float) -> bool:
        """Block until the watched state may have changed, or ``timeout_s``."""
        changed, _ = self.store.wait_for_change(self.watched_prefix(), self._since_rev, timeout_s)
        return changed

    # -- per-round master address ----------------------------------------------------------
    def master_for(self, rnd: RoundRecord, timeout_s: float) -> MasterRecord | None:
        """Rank 0's node publishes a fresh address; others wait for it (None: round moved on)."""
        key = self.keys.master(rnd.number)
        if rnd.group_rank(self.me.node_id) == 0:
            rec = MasterRecord(self.me.addr, free_port(self.me.addr))
            ok, _ = self.store.compare_and_set(key, rec.encode(), expected_revision=0)
            if not ok:
                entry = self.store.get(key)
                if entry is None:
                    return None
                rec = MasterRecord.decode(entry.value)
            self._known_master = (rnd.number, rec)
            return rec
        deadline = self.clock.monotonic() + timeout_s
        while True:
            rev = self.store.revision()
            entry = self.store.get(key)
            if entry is not None:
                found = MasterRecord.decode(entry.value)
                self._known_master = (rnd.number, found)
                return found
            # Not published yet. Decide as the agent's loop would: rank 0's node may have
            # left or died before publishing, and this agent, waiting here, may be the only
            # one left to replace the round (a proposal made here returns Wait).
            action = self.step(None)
            if not isinstance(action, Run) or action.round.number != rnd.number:
                return None
            remaining = deadline - self.clock.monotonic()
            if remaining <= 0:
                return None
            self.store.wait_for_change(self.keys.master_dir, rev, min(remaining, 1.0))

    # -- failure and completion --------------------------------------------------------------
    def _with_mine(self, rnd: RoundRecord) -> RoundRecord:
        if isinstance(rnd.members, tuple) and rnd.members:
            return rnd
        return dataclasses.replace(
            with_loader(self.store, self.keys, rnd), mine=self._slices.get(rnd.digest)
        )

    def report_failure(self, failed_round: int, root_cause: FailureCause) -> RoundRecord:
        """Start the next round after a worker failure (or end the job if restarts are spent)."""
        while True:
            rnd, rev = self.read_header()
            if rnd is None:
                return self._round_lost()
            if rnd.number != failed_round or rnd.state != RUNNING:
                # Someone already moved on (another failure or a membership change).
                return self._with_mine(rnd)
            rec = failure_round(rnd, self.settings, root_cause, floor=self.floor)
            rec = dataclasses.replace(rec, seq=self.max_seq + 1)
            ok, _ = self.store.compare_and_set(self.keys.round, rec.header(), expected_revision=rev)
            if ok:
                self.note_header(rec)
                return self._with_mine(rec)

    def _round_lost(self) -> RoundRecord:
        """The store lost the round record (it restarted) while this agent reported a
        failure: nothing to count it against; the next :meth:`step` forms a round above
        every one seen once the nodes have re-registered. Returns the round as last known."""
        log.warning("the store lost the round (restarted?) while reporting a failure: not counted")
        self.settle_until = self.clock.monotonic() + self.settings.heartbeat_timeout_s
        known = self.known_round
        return known if known is not None else RoundRecord(self.floor, PENDING, (), 0, "lost")

    def count_failure(self, root_cause: FailureCause) -> RoundRecord:
        """Live mode: count a failure against --max-restarts without changing the round
        (survivors keep running); end the job if restarts are spent."""
        while True:
            rnd, rev = self.read_header()
            if rnd is None:
                return self._round_lost()
            if rnd.state != RUNNING:
                return self._with_mine(rnd)
            rec = dataclasses.replace(
                counted_failure(rnd, self.settings, root_cause), seq=self.max_seq + 1
            )
            ok, _ = self.store.compare_and_set(self.keys.round, rec.header(), expected_revision=rev)
            if ok:
                self.note_header(rec)
                return self._with_mine(rec)

    def close(self, running_round: int) -> None:
        """Mark the job finished (no new rounds); idempotent."""
        while True:
            rnd, rev = self.read_header()
            if rnd is None or rnd.state in (CLOSED, FAILED):
                return
            rec = dataclasses.replace(
                rnd, state=CLOSED, reason="finished", exit_code=0, root_cause=None,
                seq=self.max_seq + 1,
            )
            ok, _ = self.store.compare_and_set(self.keys.round, rec.header(), expected_revision=rev)
            if ok:
                self.note_header(rec)
                return
