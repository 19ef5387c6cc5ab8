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
from collections.abc import Callable
from functools import partial
from typing import TypeVar

from flexrun._clock import SYSTEM_CLOCK, Clock
from flexrun.cause import FailureCause
from flexrun.config import RendezvousSettings
from flexrun.errors import StoreError
from flexrun.events import EventLog
from flexrun.recovery import RecoverySettings
from flexrun.rendezvous.claims import Claims
from flexrun.rendezvous.decide import (
    Action,
    Run,
    counted_failure,
    failure_round,
    within_join_timeout,
)
from flexrun.rendezvous.follower import Follower
from flexrun.rendezvous.keepalive import KeepAlive
from flexrun.rendezvous.masters import Masters
from flexrun.rendezvous.records import get_at
from flexrun.rendezvous.session import Session
from flexrun.rendezvous.state import (
    CLOSED,
    FAILED,
    FINISHED_EARLIER,
    PENDING,
    RUNNING,
    MasterRecord,
    NodeRecord,
    RoundRecord,
)
from flexrun.rendezvous.watcher import Watcher
from flexrun.store.api import Entry, Store
from flexrun.store.rejects import report_to
from flexrun.store.signed import is_signed

log = logging.getLogger("flexrun.rendezvous")
_T = TypeVar("_T")


class RendezvousHandler:
    """One node's side of the rendezvous of one job: sequences the roles over one
    :class:`~flexrun.rendezvous.session.Session`."""

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
        self.session = s = Session(
            store, run_id=run_id, me=me, settings=settings, events=events, clock=clock
        )
        self.store = store
        self.keys = s.keys
        self.me = me
        self.settings = settings
        self.events = events
        self.clock = clock
        self._since_rev = 0
        self._recovery = RecoverySettings.of(settings)
        self._masters = Masters(s)
        self._claims = Claims(s)
        self._watcher = Watcher(s)
        self._follower = Follower(s)
        self._quiet = False  # the last wait saw no change: the next step needs no read
        self._stop = s.stop
        self._keepalive = KeepAlive(s.beat, settings.heartbeat_interval_s, self._stop)
        self._changes = s.changes
        report_to(store, s.emit_rejected)  # (the store's layers rate-limit their own)

    # -- the session's state, as the agent and tests read it --------------------------------
    @property
    def round(self) -> RoundRecord | None:
        """The round this node last decided on (None: none yet)."""
        return self.session.round

    @property
    def known_round(self) -> RoundRecord | None:
        return self.session.known_round

    @property
    def floor(self) -> int:
        return self.session.floor

    @property
    def max_seq(self) -> int:
        return self.session.max_seq

    @property
    def replayed(self) -> bool:
        return self.session.replayed

    @property
    def settle_until(self) -> float:
        return self.session.settle_until

    @property
    def judges_ttl(self) -> bool:
        return self.session.judges_ttl

    @property
    def _header(self) -> RoundRecord | None:
        return self.session.header

    @property
    def stopped(self) -> bool:
        return self.session.stopped

    def rejected(self, key: str, reason: str) -> None:
        self.session.rejected(key, reason)

    # -- membership --------------------------------------------------------------------
    def join(self) -> None:
        """Announce this node and start its keep-alive."""
        s = self.session
        s.beat()
        self.store.put(self.keys.node(self.me.node_id), self.me.encode())
        s.joined_at = self.clock.monotonic()
        self._keepalive.start()
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
        self.session.beat()

    def leave(self) -> None:
        """Stop the keep-alive and remove this node so the others re-form at once (a
        watcher first hands its role over). Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._changes.close()
        self._keepalive.join(timeout_s=5)
        try:
            if self.watching:
                self._claims.hand_over()
            self.store.delete(self.keys.node(self.me.node_id))
            self.store.delete(self.keys.heartbeat(self.me.node_id))
        except StoreError as exc:
            log.warning("could not deregister from the store: %s", exc)

    def reregister(self, now: float) -> None:
        """The store lost this node's record (it restarted): register again."""
        self.session.reregister(now)

    # -- the round header --------------------------------------------------------------
    def read_header(self) -> tuple[RoundRecord | None, int]:
        """The current header and its revision (:meth:`Session.read_header`)."""
        return self.session.read_header()

    # -- deciding ------------------------------------------------------------------------
    def step(self, running: int | None) -> Action:
        """Read what this node's role needs, decide, and perform a proposal or a claim.

        Returns the decided action; a performed proposal returns ``Wait`` so the caller
        reads again (whether or not it won). A follower whose last :meth:`wait` saw no
        change decides from what it read before, without a request (when its claim check
        is due, with the watcher's keep-alive alone).
        """
        now = self.clock.monotonic()
        quiet, self._quiet = self._quiet, False
        if (
            quiet
            and not self.watching
            and self._follower.settled(self._claims.held_elsewhere())
            and (not self._claims.due(now) or self._claims.quiet_check(now))
        ):
            return self._checked(self._follower.again(running), running, now)
        s = self.session
        copied = s.copied(self.keys.round)
        if copied is not None:
            entry, self._since_rev = copied  # (no request: the round directory's copy)
        else:
            entry, self._since_rev = get_at(self.store, self.keys.round)
        read = (self._since_rev, now)  # (the clock was read first: the revision is no older)
        hdr, rev = s.header_of(entry)
        now = self.clock.monotonic()
        self._claims.update(hdr, rev, now)
        if self.watching:
            action = self._watcher.step(running, hdr, rev, read=read)
        else:
            action = self._follower.step(running, hdr, now)
        self._changes.arm(self.watched_prefix(), self._since_rev, copy=not self.watching)
        return self._checked(action, running, now)

    def read_round_key(self, key: str) -> Entry | None:
        """A key of the round directory (:meth:`Session.read_round_key`)."""
        return self.session.read_round_key(key)

    @property
    def watching(self) -> bool:
        """Whether this node is the watcher (reads membership and proposes rounds)."""
        return self._claims.watching

    def _checked(self, action: Action, running: int | None, now: float) -> Action:
        since = now - self.session.joined_at
        return within_join_timeout(action, self.round, running, self.settings, since)

    # -- waiting ------------------------------------------------------------------------
    def watched_prefix(self) -> str:
        """What :meth:`wait` waits on: the watcher all of ``s/``, the others the round."""
        return self.keys.watched if self.watching else self.keys.round_dir

    def wait(self, timeout_s: float) -> bool:
        """Block until the watched state may have changed since the last :meth:`step`, or
        ``timeout_s``. One long store watch in the background serves every call (see
        :mod:`flexrun.rendezvous.changewatch`): a short wait costs no request; where the
        store's notifications carry values, a follower's next step reads none either."""
        changed = self._changes.wait(timeout_s)
        self._quiet = not changed
        return changed

    # -- per-round master address ----------------------------------------------------------
    def master_for(self, rnd: RoundRecord, timeout_s: float, port: int = 0) -> MasterRecord | None:
        """Round ``rnd``'s master address (:mod:`flexrun.rendezvous.masters`): group rank
        0's node publishes ``port`` or a free one; the others wait for the publication
        (None: the round moved on, or ``timeout_s`` passed)."""
        if rnd.group_rank(self.me.node_id) == 0:
            return self._masters.publish(rnd, port)
        published = partial(self._masters.published, rnd.number)
        found = self.await_in_round(rnd.number, timeout_s, published)
        if found is not None:
            self._masters.seen(rnd.number, found)
        return found

    def await_in_round(self, n: int, timeout_s: float, get: Callable[[], _T | None]) -> _T | None:
        """``get()`` once not None (None: round ``n`` moved on, or ``timeout_s`` passed)."""
        deadline = self.clock.monotonic() + timeout_s
        while (got := get()) is None:
            # Not there yet (a master address; a static round's marks). Decide as the agent's
            # loop would: rank 0's node may have left or died before publishing, and this
            # agent, waiting here, may be the only one left to replace the round (a proposal
            # made here returns Wait).
            action = self.step(None)
            if not isinstance(action, Run) or action.round.number != n:
                return None
            remaining = deadline - self.clock.monotonic()
            if remaining <= 0 or self.stopped:
                return None
            # Both are written under the round directory, which this node's change watch
            # follows from its last read: the write (or a new header) wakes the wait, at no
            # request; the keep-alive interval bounds it so that the step above
            # still checks on the watcher when nothing changes.
            self.wait(min(remaining, self.settings.heartbeat_interval_s))
        return got

    def published_master(self, number: int) -> MasterRecord | None:
        return self._masters.published(number)

    # -- failure and completion --------------------------------------------------------------
    def _with_mine(self, rnd: RoundRecord) -> RoundRecord:
        if isinstance(rnd.members, tuple) and rnd.members:
            return rnd
        return self._follower.with_slice(rnd)

    def _rewrite(self, make: Callable[[RoundRecord], RoundRecord | None]) -> RoundRecord | None:
        """Compare-and-set the header to ``make(current)`` until it sticks; ``make`` returns
        None when there is nothing to write (the current header is returned then). None:
        the store lost the round."""
        while True:
            rnd, rev = self.read_header()
            if rnd is None:
                return None
            rec = make(rnd)
            if rec is None:
                return self._with_mine(rnd)
            rec = dataclasses.replace(rec, seq=self.max_seq + 1)
            ok, won = self.store.compare_and_set(
                self.keys.round, rec.header(), expected_revision=rev
            )
            if ok:
                s = self.session
                s.note_header(rec)
                s.high_rev = max(s.high_rev, won.revision if won is not None else 0)
                return self._with_mine(rec)

    def report_failure(
        self, failed_round: int, root_cause: FailureCause, *, progressed: bool | None = None
    ) -> RoundRecord:  # noqa: E501
        """Start the next round after a worker failure (or end the job if restarts are
        spent, or in a crash loop: ``progressed`` False); a round someone already moved
        on from is returned as it is."""

        def make(r: RoundRecord) -> RoundRecord | None:
            if r.number != failed_round or r.state != RUNNING:
                return None
            return failure_round(
                r, self._recovery, root_cause, floor=self.floor, progressed=progressed
            )  # noqa: E501

        return self._rewrite(make) or self._round_lost()

    def _round_lost(self) -> RoundRecord:
        """The store lost the round record (it restarted) while this agent reported a
        failure: nothing to count it against; the next :meth:`step` forms a round above
        every one seen once the nodes have re-registered. Returns the round as last known."""
        log.warning("the store lost the round (restarted?) while reporting a failure: not counted")
        self.session.settle_until = self.clock.monotonic() + self.settings.heartbeat_timeout_s
        known = self.known_round
        return known if known is not None else RoundRecord(self.floor, PENDING, (), 0, "lost")

    def count_failure(
        self, root_cause: FailureCause, *, progressed: bool | None = None
    ) -> RoundRecord:  # noqa: E501
        """Live mode: count a failure against --max-restarts without changing the round
        (survivors keep running); end the job if restarts are spent."""
        now = self.clock.wall()

        def make(r: RoundRecord) -> RoundRecord | None:
            if r.state != RUNNING:
                return None
            return counted_failure(r, self._recovery, root_cause, now=now, progressed=progressed)

        return self._rewrite(make) or self._round_lost()

    def close(self, running_round: int) -> None:
        """Mark the job finished (no new rounds); idempotent. ``running_round``: the round
        whose workers completed here; when a later round was formed meanwhile, its members
        stop their workers instead of waiting for them (see ``decide.round_ended``)."""

        def make(r: RoundRecord) -> RoundRecord | None:
            if r.state in (CLOSED, FAILED):
                return None
            reason = "finished" if r.number == running_round else FINISHED_EARLIER
            return dataclasses.replace(r, state=CLOSED, reason=reason, exit_code=0, root_cause=None)

        self._rewrite(make)
