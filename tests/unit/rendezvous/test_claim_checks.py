"""How often followers check on the watcher: the first group ranks at the full rate, the
rest ten times less often (:func:`flexrun.rendezvous.follow.claim_check_interval`)."""

from __future__ import annotations

from rdzv_store_doubles import forward_value_watches

from flexrun.config import RendezvousSettings
from flexrun.events import EventLog
from flexrun.rendezvous import NodeRecord, RendezvousHandler, Run
from flexrun.rendezvous.follow import DEPUTIES, EARLY_CHECKS, SPARSE_CHECKS, claim_check_interval
from flexrun.store.api import Entry
from flexrun.store.memory import MemoryStore
from flexrun.testing import FakeClock

S7 = RendezvousSettings(
    min_nodes=1, max_nodes=7, last_call_s=0, heartbeat_interval_s=1, heartbeat_timeout_s=3
)
BASE_S = 1.5  # max(heartbeat_interval, heartbeat_timeout / 2)


COPIES = ("get_prefix_at", "watch_values")  # the api's value-carrying watch (etcd has it)


ROUND_DIR = "flexrun/job/s/round/"
HEARTBEATS = "flexrun/job/hb/"


class ClaimReads:
    """A node's store, counting its reads of the watcher claim, of the round header and
    of other nodes' keep-alives (``checks``: every claim check reads the holder's once).
    Without ``copies``, a store whose watches carry no values (as the tcp store)."""

    def __init__(self, inner: MemoryStore, node: str, *, copies: bool = False) -> None:
        self.inner = inner
        self.own_beat = HEARTBEATS + node
        self.claim_reads = 0
        self.header_reads = 0
        self.checks = 0
        self.copies = copies
        if copies:
            forward_value_watches(self, inner)

    def __getattr__(self, name: str) -> object:
        if name in COPIES and not self.copies:
            raise AttributeError(name)
        return getattr(self.inner, name)

    def reset(self) -> None:
        self.claim_reads = self.header_reads = self.checks = 0

    def get(self, key: str) -> Entry | None:
        self.claim_reads += key == ROUND_DIR + "watcher"
        self.header_reads += key == ROUND_DIR + "current"
        self.checks += key.startswith(HEARTBEATS) and key != self.own_beat
        return self.inner.get(key)


def _node(
    store: MemoryStore,
    node: str,
    clock: FakeClock,
    settings: RendezvousSettings = S7,
    *,
    copies: bool = False,
) -> tuple[RendezvousHandler, ClaimReads]:
    spy = ClaimReads(store, node, copies=copies)
    h = RendezvousHandler(
        spy,  # type: ignore[arg-type]
        run_id="job",
        me=NodeRecord(node, "127.0.0.1", 1),
        settings=settings,
        events=EventLog(None, run_id="job", node=node),
        clock=clock,
    )
    h._beat()
    store.put(h.keys.node(node), h.me.encode())
    return h, spy


def _formed(
    clock: FakeClock, *, copies: bool = False
) -> tuple[list[RendezvousHandler], list[ClaimReads]]:
    store = MemoryStore(clock)
    nodes = [_node(store, n, clock, copies=copies) for n in "abcdefg"]
    hs, spies = [h for h, _ in nodes], [s for _, s in nodes]
    hs[0].step(None)  # a claims the watcher role and proposes [a..g]
    for h in hs:
        for _ in range(6):
            if isinstance(h.step(None), Run):
                break
    assert hs[0].watching and all(h.round is not None for h in hs)
    assert [h.round.group_rank(h.me.node_id) for h in hs] == list(range(7))  # type: ignore[union-attr]
    return hs, spies


def _sparse_interval(clock: FakeClock, hs: list[RendezvousHandler], spies: list[ClaimReads]) -> None:
    """One sparse interval of agent ticks in a running round, the reads counted from 0."""
    for s in spies:
        s.reset()
    for _ in range(int(SPARSE_CHECKS * BASE_S / 0.5)):
        clock.advance(0.5)
        for h in hs:
            h._beat()
            h.wait(0)
            h.step(1)


def _until_replaced(clock: FakeClock, alive: list[RendezvousHandler]) -> list[RendezvousHandler]:
    """Tick the survivors of a killed watcher until one of them watches; within its
    keep-alive timeout and two claim checks."""
    t_dead = clock.monotonic()
    while not any(h.watching for h in alive):
        assert clock.monotonic() - t_dead <= S7.heartbeat_timeout_s + 2 * BASE_S
        clock.advance(0.5)
        for h in alive:
            h._beat()
            h.wait(0)
            h.step(1)
    return alive


def test_the_first_group_ranks_check_the_watcher_at_the_full_rate_the_others_ten_times_less() -> None:
    assert claim_check_interval(BASE_S, None) == BASE_S  # no round, no slice, not a member
    assert claim_check_interval(BASE_S, None, EARLY_CHECKS - 1) == BASE_S
    assert claim_check_interval(BASE_S, None, EARLY_CHECKS) == BASE_S * SPARSE_CHECKS
    assert all(claim_check_interval(BASE_S, r) == BASE_S for r in range(DEPUTIES + 1))
    assert claim_check_interval(BASE_S, DEPUTIES + 1) == BASE_S * SPARSE_CHECKS
    # Deputies of a running round at their own rate (the agent: half a heartbeat interval);
    # nodes without a rank and the ranks past the deputies keep theirs.
    assert all(claim_check_interval(BASE_S, r, deputy_s=0.5) == 0.5 for r in range(DEPUTIES + 1))
    assert claim_check_interval(BASE_S, None, deputy_s=0.5) == BASE_S
    assert claim_check_interval(BASE_S, DEPUTIES + 1, deputy_s=0.5) == BASE_S * SPARSE_CHECKS


def test_a_running_round_costs_the_followers_outside_the_first_ranks_a_tenth_of_the_claim_checks() -> (
    None
):
    clock = FakeClock()
    hs, spies = _formed(clock)
    _sparse_interval(clock, hs, spies)
    deputies = [s.checks for s in spies[1 : DEPUTIES + 1]]
    rest = [s.checks for s in spies[DEPUTIES + 1 :]]
    assert min(deputies) >= SPARSE_CHECKS - 1, deputies
    assert max(rest) <= 1, rest


def test_a_claim_check_in_a_quiet_round_reads_the_watchers_keep_alive_alone() -> None:
    """Nothing under the round directory changed since a follower's last read (its watch
    says so): the claim and the header are as read, so a due check reads neither (on the
    tcp store 2 requests instead of 7)."""
    clock = FakeClock()
    hs, spies = _formed(clock)
    _settle(hs)
    _sparse_interval(clock, hs, spies)
    followers = spies[1:]
    assert min(s.checks for s in followers[:DEPUTIES]) >= SPARSE_CHECKS - 1
    assert [(s.claim_reads, s.header_reads) for s in followers] == [(0, 0)] * 6


def test_a_quiet_check_that_finds_the_watcher_dead_reads_the_claim_before_taking_it() -> None:
    clock = FakeClock()
    hs, spies = _formed(clock)
    _settle(hs)
    for s in spies:
        s.reset()
    alive = _until_replaced(clock, hs[1:])  # a, the watcher, is SIGKILLed
    new = next(h for h in alive if h.watching)
    assert spies[hs.index(new)].claim_reads >= 1  # (read again: the compare-and-set's revision)
    assert sum(h.watching for h in alive) == 1


def _settle(hs: list[RendezvousHandler]) -> None:
    """Let every follower's watch start from its last read and report nothing new, as
    when the round runs (real threads: bounded in wall time)."""
    import time

    for h in hs[1:]:
        t0 = time.monotonic()
        while True:
            h.step(1)
            if not h.wait(0.2):  # (quiet: the next step reads nothing)
                break
            assert time.monotonic() - t0 < 5, h.me.node_id
        h._quiet = False


def test_a_killed_watcher_is_replaced_by_a_deputy_within_timeout_plus_two_checks() -> None:
    clock = FakeClock()
    hs, _ = _formed(clock)
    for _ in range(int(SPARSE_CHECKS * BASE_S)):  # long past every node's first check
        clock.advance(1.0)
        for h in hs:
            h._beat()
            h.step(1)
    # a (the watcher, rank 0) is SIGKILLed: no more beats or steps.
    alive = _until_replaced(clock, hs[1:])
    took_over = [h.me.node_id for h in alive if h.watching]
    assert len(took_over) == 1 and took_over[0] in "bcd", took_over
    new = next(h for h in alive if h.watching)
    new.step(1)  # proposes the round without a
    for h in alive:
        h.wait(0)
        act = h.step(1)
        for _ in range(4):
            if isinstance(act, Run):
                break
            act = h.step(1)
        assert isinstance(act, Run) and act.round.number == 2
        assert act.round.reason == "node_lost"


S_WAITING = RendezvousSettings(  # MIN 9 of the 7 nodes: no round forms
    min_nodes=9, max_nodes=9, last_call_s=0, heartbeat_interval_s=1, heartbeat_timeout_s=3,
    join_timeout_s=10_000,
)


def _waiting(clock: FakeClock) -> tuple[list[RendezvousHandler], list[ClaimReads]]:
    store = MemoryStore(clock)
    nodes = [_node(store, n, clock, S_WAITING) for n in "abcdefg"]
    hs, spies = [h for h, _ in nodes], [s for _, s in nodes]
    for h in hs:
        h.step(None)
    assert hs[0].watching and not any(h.watching for h in hs[1:])
    return hs, spies


def test_nodes_waiting_for_a_round_check_the_watcher_at_the_full_rate_only_at_first() -> None:
    """A formation that takes long (thousands of nodes, or MIN not reached) costs a node
    EARLY_CHECKS claim reads and then one per sparse interval, not one per BASE_S."""
    clock = FakeClock()
    hs, spies = _waiting(clock)
    for s in spies:
        s.reset()
    ticks = int(2 * SPARSE_CHECKS * BASE_S / 0.5)  # two sparse intervals of agent ticks
    for _ in range(ticks):
        clock.advance(0.5)
        for h in hs:
            h._beat()
            h.wait(0)
            h.step(None)
    assert all(h.round is None or h.round.state != "running" for h in hs)
    followers = [s.checks for s in spies[1:]]
    # full rate would be 2 x SPARSE_CHECKS (20) checks in this time
    assert max(followers) <= EARLY_CHECKS + 3, followers
    assert min(followers) >= EARLY_CHECKS, followers


def test_a_watcher_killed_before_the_first_round_is_still_replaced() -> None:
    clock = FakeClock()
    hs, _ = _waiting(clock)
    for _ in range(int(2 * SPARSE_CHECKS * BASE_S)):  # every follower checks sparsely now
        clock.advance(1.0)
        for h in hs:
            h._beat()
            h.step(None)
    t_dead = clock.monotonic()  # a, the watcher, is SIGKILLed
    alive = hs[1:]
    while not any(h.watching for h in alive):
        assert clock.monotonic() - t_dead <= S_WAITING.heartbeat_timeout_s + (SPARSE_CHECKS + 1) * BASE_S
        clock.advance(0.5)
        for h in alive:
            h._beat()
            h.step(None)
    assert sum(h.watching for h in alive) == 1


def test_where_the_store_carries_values_the_claim_checks_read_the_copy_and_a_dead_watcher_is_replaced() -> (
    None
):
    """With the round directory kept as a copy (etcd), a follower's claim checks cost no
    read of the claim, and the deputies still replace a SIGKILLed watcher in time: they
    read its keep-alive, which no copy holds."""
    import time

    clock = FakeClock()
    hs, spies = _formed(clock, copies=True)
    for h in hs[1:]:  # let every follower's watch read the round directory once
        t0 = time.monotonic()
        while h._changes.read(h.keys.round) is None:
            h.wait(0.05)
            assert time.monotonic() - t0 < 20, "the watch never read the round directory"
        h.step(1)
    _sparse_interval(clock, hs, spies)
    assert [s.claim_reads for s in spies[1:]] == [0] * 6  # (the watcher reads it: a store read)
    alive = _until_replaced(clock, hs[1:])  # a, the watcher, is SIGKILLed
    assert sum(h.watching for h in alive) == 1
    new = next(h for h in alive if h.watching)
    new.step(1)  # proposes the round without a
    for h in alive:
        t0 = time.monotonic()
        act = h.step(1)
        while not (isinstance(act, Run) and act.round.number == 2):
            assert time.monotonic() - t0 < 5, act
            h.wait(0.1)  # (the copy lags the store by the watch's delivery)
            act = h.step(1)
        assert act.round.reason == "node_lost"
    for h in hs:
        h.leave()
