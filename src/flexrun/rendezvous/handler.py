"""Carries out rendezvous decisions against a store: join, keep-alive, propose, close.

Owns every store access of the rendezvous and the local bookkeeping the pure decisions
need (when the set of alive nodes last changed). It does not decide (``decide.py``) and
does not touch processes (the agent does).
"""

from __future__ import annotations

import logging
import socket
import threading

from flexrun._clock import SYSTEM_CLOCK, Clock
from flexrun.cause import FailureCause
from flexrun.config import RendezvousSettings
from flexrun.errors import RendezvousTimeout, StoreError
from flexrun.events import EventLog
from flexrun.rendezvous.decide import (
    Action,
    Propose,
    Run,
    View,
    Wait,
    counted_failure,
    decide,
    next_round,
    watches_membership,
)
from flexrun.rendezvous.state import (
    CLOSED,
    FAILED,
    PENDING,
    RUNNING,
    Keys,
    MasterRecord,
    NodeRecord,
    RoundRecord,
)
from flexrun.store.api import Store

log = logging.getLogger("flexrun.rendezvous")


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
        self._known_round: RoundRecord | None = None
        self._floor = 0  # the highest round number seen: new rounds are numbered above it
        self._known_master: tuple[int, MasterRecord] | None = None
        self._settle_until = 0.0
        self._round_rev = 0
        self._since_rev = 0
        self._watch_all = True  # see watches_membership
        self._alive_set: frozenset[str] = frozenset()
        # Keep-alives this agent has seen: node -> (first revision seen, seen renewed since).
        # Only where readers judge TTLs themselves (tcp): see View.unconfirmed.
        self._beats_seen: dict[str, tuple[int, bool]] = {}
        self._judges_ttl = bool(getattr(store, "judges_ttl_locally", False))
        self._candidates_since = clock.monotonic()
        self._joined_at = clock.monotonic()
        self._stop = threading.Event()
        self._hb_thread: threading.Thread | None = None
        self._hb_failing = False

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

    def _beat(self) -> None:
        self.store.put(
            self.keys.heartbeat(self.me.node_id), b"1", ttl_s=self.settings.heartbeat_timeout_s
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
        """Stop the keep-alive and remove this node so the others re-form at once.
        Idempotent: a preempted agent leaves early, and again on its way out."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._hb_thread is not None:
            self._hb_thread.join(timeout=5)
        try:
            self.store.delete(self.keys.node(self.me.node_id))
            self.store.delete(self.keys.heartbeat(self.me.node_id))
        except StoreError as exc:
            log.warning("could not deregister from the store: %s", exc)

    # -- reading and deciding ------------------------------------------------------------
    def _read(self) -> tuple[RoundRecord | None, dict[str, tuple[NodeRecord, int]], frozenset[str]]:
        self._since_rev = self.store.revision()
        entry = self.store.get(self.keys.round)
        if entry is None:
            rnd, self._round_rev = None, 0
        else:
            rnd, self._round_rev = RoundRecord.decode(entry.value), entry.revision
            self._floor = max(self._floor, rnd.number)
        nodes = self.store.get_prefix(self.keys.nodes)
        beats = self.store.get_prefix(self.keys.heartbeats)
        alive: dict[str, tuple[NodeRecord, int]] = {}
        registered = set()
        for key, e in nodes.items():
            node_id = key[len(self.keys.nodes) :]
            registered.add(node_id)
            if self.keys.heartbeat(node_id) in beats or (
                node_id == self.me.node_id and not self._stop.is_set()
            ):
                # An agent that reads is alive, whatever its own keep-alive looks like (a
                # keep-alive thread starved past the TTL must not make it drop itself);
                # the others judge it by the keep-alive.
                alive[node_id] = (NodeRecord.decode(e.value), e.revision)
        if self._judges_ttl:
            seen = {}
            for node_id in alive:
                beat = beats.get(self.keys.heartbeat(node_id))
                rev = beat.revision if beat is not None else 0
                first, renewed = self._beats_seen.get(node_id, (rev, node_id == self.me.node_id))
                seen[node_id] = (first, renewed or rev != first)
            self._beats_seen = seen  # a node that vanishes is unconfirmed when it returns
        return rnd, alive, frozenset(registered)

    def _unconfirmed(self) -> frozenset[str]:
        return frozenset(n for n, (_, renewed) in self._beats_seen.items() if not renewed)

    def step(self, running: int | None) -> Action:
        """Read the store, decide, and perform a proposal if that is the decision.

        Returns the decided action; a performed proposal returns ``Wait`` so the caller
        reads again (whether or not this agent's proposal won).
        """
        rnd, alive, registered = self._read()
        now = self.clock.monotonic()
        if self.me.node_id not in registered and not self._stop.is_set():
            # The store lost our record (it restarted): register again.
            self.store.put(self.keys.node(self.me.node_id), self.me.encode())
            self._beat()
            self._settle_until = now + self.settings.heartbeat_timeout_s
            self._joined_at = now  # the join timeout counts from this (re)join
            self.events.emit("store_rejoined", node_id=self.me.node_id)
            log.warning("the store lost this node's record (restarted?): registered again")
            rnd, alive, registered = self._read()
        if rnd is None and running is not None and self._known_round is not None:
            # The round we train in vanished with the store's state: restore it, so that a
            # store restart costs the running job nothing (first writer wins, all agree).
            self.store.compare_and_set(
                self.keys.round, self._known_round.encode(), expected_revision=0
            )
            known = self._known_round.number
            if self._known_master is not None and self._known_master[0] == known:
                # A member still waiting for the round's address would wait for ever.
                self.store.compare_and_set(
                    self.keys.master(known), self._known_master[1].encode(), expected_revision=0
                )
            self._settle_until = now + self.settings.heartbeat_timeout_s
            self.events.emit("round_restored", round=self._known_round.number)
            rnd, alive, registered = self._read()
        self.round = rnd
        if rnd is not None:
            self._known_round = rnd
        alive_set = frozenset(alive)
        if alive_set != self._alive_set:
            self._alive_set = alive_set
            self._candidates_since = now
        view = View(
            me=self.me.node_id,
            round=rnd,
            alive=alive,
            registered=registered,
            running=running,
            now=now,
            candidates_since=self._candidates_since,
            settle_until=self._settle_until,
            floor=self._floor,
            unconfirmed=self._unconfirmed(),
        )
        self._watch_all = watches_membership(view)
        action = decide(view, self.settings)
        if isinstance(action, Propose):
            self._propose(action)
            return Wait("proposed a new round")
        if (
            isinstance(action, Wait)
            and (rnd is None or rnd.state not in (CLOSED, FAILED))
            and running is None
            and (rnd is None or len(rnd.members) < self.settings.min_nodes)
            and now - self._joined_at > self.settings.join_timeout_s
        ):
            raise RendezvousTimeout(
                f"rendezvous timed out after {self.settings.join_timeout_s:g}s: {len(alive)} node(s) "
                f"present, --nnodes MIN is {self.settings.min_nodes}; start more nodes or lower MIN"
            )
        return action

    def _propose(self, p: Propose) -> bool:
        ok, _ = self.store.compare_and_set(
            self.keys.round, p.record.encode(), expected_revision=self._round_rev
        )
        if ok:
            rec = p.record
            self._floor = max(self._floor, rec.number)
            for n in p.lost:
                self.events.emit("node_lost", node_id=n, round=rec.number)
            for n in p.left:
                self.events.emit("node_left", node_id=n, round=rec.number)
            if rec.reason == "scale_up":
                self.events.emit(
                    "scale_up", round=rec.number, joined=list(p.joined), nodes=len(rec.members)
                )
            elif rec.reason in ("node_lost", "node_left"):
                self.events.emit("scale_down", round=rec.number, nodes=len(rec.members))
            log.info(
                "round %d proposed (%s): %s", rec.number, rec.reason, rec.member_ids or rec.state
            )
        return ok

    def watched_prefix(self) -> str:
        """What :meth:`wait` waits on: all rendezvous state, or only the round record."""
        return self.keys.watched if self._watch_all else self.keys.round_dir

    def wait(self, timeout_s: float) -> bool:
        """Block until the watched state may have changed, or ``timeout_s``.

        Only the agent that watches membership is woken by node records; the others by
        the round record (or the timeout, after which the caller steps anyway).
        """
        changed, _ = self.store.wait_for_change(self.watched_prefix(), self._since_rev, timeout_s)
        return changed

    # -- per-round master address ----------------------------------------------------------
    def master_for(self, rnd: RoundRecord, timeout_s: float) -> MasterRecord | None:
        """Rank 0's node publishes a fresh address; others wait for it (None: round moved on)."""
        key = self.keys.master(rnd.number)
        if rnd.group_rank(self.me.node_id) == 0:
            rec = MasterRecord(self.me.addr, free_port(self.me.addr))
            ok, current = self.store.compare_and_set(key, rec.encode(), expected_revision=0)
            if not ok:
                assert current is not None
                rec = MasterRecord.decode(current.value)
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
            self.store.wait_for_change(self.keys.watched, rev, min(remaining, 1.0))

    # -- failure and completion --------------------------------------------------------------
    def report_failure(self, failed_round: int, root_cause: FailureCause) -> RoundRecord:
        """Start the next round after a worker failure (or end the job if restarts are spent)."""
        while True:
            rnd, alive, _ = self._read()
            if rnd is None:
                return self._round_lost()
            if rnd.number != failed_round or rnd.state != "running":
                # Someone already moved on (another failure or a membership change).
                return rnd
            rec = next_round(
                rnd,
                alive,
                self.settings,
                "failure",
                failure=True,
                root_cause=root_cause,
                floor=self._floor,
            )
            ok, _ = self.store.compare_and_set(
                self.keys.round, rec.encode(), expected_revision=self._round_rev
            )
            if ok:
                self._floor = max(self._floor, rec.number)
                return rec

    def _round_lost(self) -> RoundRecord:
        """The store lost the round record (it restarted) while this agent reported a
        failure: nothing to count it against; the next :meth:`step` forms a round above
        every one seen once the nodes have re-registered. Returns the round as last known."""
        log.warning("the store lost the round (restarted?) while reporting a failure: not counted")
        self._settle_until = self.clock.monotonic() + self.settings.heartbeat_timeout_s
        known = self._known_round
        return known if known is not None else RoundRecord(self._floor, PENDING, (), 0, "lost")

    def count_failure(self, root_cause: FailureCause) -> RoundRecord:
        """Live mode: count a failure against --max-restarts without changing the round
        (survivors keep running); end the job if restarts are spent."""
        while True:
            rnd, _, _ = self._read()
            if rnd is None:
                return self._round_lost()
            if rnd.state != RUNNING:
                return rnd
            rec = counted_failure(rnd, self.settings, root_cause)
            ok, _ = self.store.compare_and_set(
                self.keys.round, rec.encode(), expected_revision=self._round_rev
            )
            if ok:
                self._floor = max(self._floor, rec.number)
                return rec

    def close(self, running_round: int) -> None:
        """Mark the job finished (no new rounds); idempotent."""
        while True:
            rnd, _, _ = self._read()
            if rnd is None or rnd.state in (CLOSED, FAILED):
                return
            rec = RoundRecord(rnd.number, CLOSED, rnd.members, rnd.restarts, "finished")
            ok, _ = self.store.compare_and_set(
                self.keys.round, rec.encode(), expected_revision=self._round_rev
            )
            if ok:
                return
