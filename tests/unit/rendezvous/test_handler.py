"""The handler against the in-memory store (and the real tcp store, whose readers judge
keep-alive TTLs themselves) with a fake clock: proposals race safely."""

from __future__ import annotations

import pytest

from flexrun.cause import FailureCause
from flexrun.config import RendezvousSettings
from flexrun.events import EventLog
from flexrun.rendezvous import NodeRecord, RendezvousHandler, Run, Wait
from flexrun.rendezvous.state import Keys, RoundRecord
from flexrun.store.api import Store
from flexrun.store.memory import MemoryStore
from flexrun.store.tcp import TcpStore, TcpStoreServer
from flexrun.testing import FakeClock


def _handler(store: Store, node: str, clock: FakeClock, s: RendezvousSettings) -> RendezvousHandler:
    h = RendezvousHandler(
        store,
        run_id="job",
        me=NodeRecord(node, "127.0.0.1", 1),
        settings=s,
        events=EventLog(None, run_id="job", node=node),
        clock=clock,
    )
    h._beat()  # one keep-alive, no thread: the test drives time
    store.put(h.keys.node(node), h.me.encode())
    return h


def test_two_nodes_form_one_round_and_both_run_it() -> None:
    clock = FakeClock()
    store = MemoryStore(clock)
    s = RendezvousSettings(min_nodes=2, max_nodes=2, last_call_s=0)
    a, b = _handler(store, "a", clock, s), _handler(store, "b", clock, s)
    assert isinstance(a.step(None), Wait)  # proposed
    assert isinstance(b.step(None), Run)
    act = a.step(None)
    assert isinstance(act, Run) and act.round.member_ids == ["a", "b"] and act.round.number == 1


def test_a_silent_node_is_dropped_after_the_heartbeat_timeout() -> None:
    clock = FakeClock()
    store = MemoryStore(clock)
    s = RendezvousSettings(
        min_nodes=1, max_nodes=2, last_call_s=0, heartbeat_interval_s=1, heartbeat_timeout_s=3
    )
    a, b = _handler(store, "a", clock, s), _handler(store, "b", clock, s)
    a.step(None)
    assert isinstance(a.step(None), Run)
    for _ in range(2):
        clock.advance(1)
        a._beat()  # b stays silent
        assert isinstance(a.step(1), Wait)
        assert a.round is not None and a.round.number == 1
    clock.advance(1.5)
    a._beat()
    a.step(1)  # proposes the survivors' round
    act = a.step(1)
    assert isinstance(act, Run) and act.round.member_ids == ["a"] and act.round.number == 2
    assert b.round is None or b.round.number == 1


def test_a_joiner_that_does_not_watch_membership_is_woken_by_the_round_only() -> None:
    clock = FakeClock()
    store = MemoryStore(clock)
    s = RendezvousSettings(min_nodes=3, max_nodes=3, last_call_s=0)
    a, b = _handler(store, "a", clock, s), _handler(store, "b", clock, s)
    assert isinstance(a.step(None), Wait) and isinstance(b.step(None), Wait)  # 2 of 3
    assert a.watched_prefix() == a.keys.watched  # a joined first
    assert b.watched_prefix() == b.keys.round_dir
    c = _handler(store, "c", clock, s)  # c joins: only a is woken
    assert a.wait(0) and not b.wait(0)
    assert isinstance(a.step(None), Wait)  # a proposes round 1
    assert b.wait(0)  # the round record wakes b
    assert isinstance(b.step(None), Run) and isinstance(c.step(None), Run)


def test_an_agent_that_is_not_woken_still_proposes_when_it_steps() -> None:
    """Watching only the round never changes a decision: a silent first joiner is covered."""
    clock = FakeClock()
    store = MemoryStore(clock)
    s = RendezvousSettings(min_nodes=2, max_nodes=2, last_call_s=0)
    _handler(store, "a", clock, s)
    b = _handler(store, "b", clock, s)
    assert b.watched_prefix() == b.keys.watched  # b has not read yet: watches everything
    assert isinstance(b.step(None), Wait)  # b proposes (a never steps)
    act = b.step(None)
    assert isinstance(act, Run) and act.round.member_ids == ["a", "b"]
    assert b.watched_prefix() == b.keys.round_dir


def _round_of_two(clock: FakeClock, store: MemoryStore) -> tuple[RendezvousHandler, ...]:
    s = RendezvousSettings(
        min_nodes=1, max_nodes=3, last_call_s=0, heartbeat_interval_s=1, heartbeat_timeout_s=3
    )
    a, b = _handler(store, "a", clock, s), _handler(store, "b", clock, s)
    a.step(None)  # proposes round 1: [a, b], a is rank 0
    act = b.step(None)
    assert isinstance(act, Run) and act.round.member_ids == ["a", "b"]
    return a, b


def test_a_peer_that_leaves_before_publishing_the_master_does_not_strand_the_round() -> None:
    """Chaos finding: rank 0's node was preempted between the round's proposal and the
    master address; the survivor waited in master_for for a round nobody would replace."""
    clock = FakeClock()
    store = MemoryStore(clock)
    a, b = _round_of_two(clock, store)
    assert b.round is not None
    rnd = b.round
    a.leave()  # graceful: node record and keep-alive deleted
    assert b.master_for(rnd, timeout_s=0) is None
    cur = b.step(None)
    assert isinstance(cur, Run) and cur.round.number == 2 and cur.round.member_ids == ["b"]
    assert cur.round.reason == "node_left"


def test_a_peer_killed_before_publishing_the_master_is_dropped_on_its_stale_keep_alive() -> None:
    """A member killed while the round is still forming goes after the heartbeat timeout,
    not after the join timeout."""
    clock = FakeClock()
    store = MemoryStore(clock)
    a, b = _round_of_two(clock, store)
    assert b.round is not None
    rnd = b.round
    clock.advance(3.5)  # a was SIGKILLed: its record stays, its keep-alive goes stale
    b._beat()
    assert b.master_for(rnd, timeout_s=0) is None
    cur = b.step(None)
    assert isinstance(cur, Run) and cur.round.number == 2 and cur.round.member_ids == ["b"]
    assert cur.round.reason == "node_lost"


def test_a_live_rank_0_is_waited_for() -> None:
    clock = FakeClock()
    store = MemoryStore(clock)
    a, b = _round_of_two(clock, store)
    assert b.round is not None
    rnd = b.round
    assert b.master_for(rnd, timeout_s=0) is None  # not published yet: the round stands
    assert b.round is not None and b.round.number == 1
    act = a.step(None)
    assert isinstance(act, Run)
    published = a.master_for(act.round, timeout_s=0)
    assert published is not None and b.master_for(rnd, timeout_s=0) == published


def _two_agents(
    *, min_nodes: int, max_nodes: int, **extra: float
) -> tuple[FakeClock, MemoryStore, RendezvousHandler, RendezvousHandler]:
    """Agents a and b on one memory store: no last call, 1 s keep-alives, 3 s timeout."""
    clock = FakeClock()
    store = MemoryStore(clock)
    s = RendezvousSettings(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        last_call_s=0,
        heartbeat_interval_s=1,
        heartbeat_timeout_s=3,
        **extra,
    )
    return clock, store, _handler(store, "a", clock, s), _handler(store, "b", clock, s)


def _wipe(store: MemoryStore) -> None:
    """What a restarted store holds of this job: nothing."""
    for key in list(store.get_prefix("flexrun/")):
        store.delete(key)


def test_round_numbers_never_go_back_after_a_store_restart_while_nobody_runs() -> None:
    clock, store, a, b = _two_agents(min_nodes=1, max_nodes=2)
    a.step(None)
    act = b.step(None)
    assert isinstance(act, Run) and act.round.number == 1
    _wipe(store)  # the store restarted before either agent started the round's workers
    numbers = []
    for _ in range(8):
        for h in (a, b):
            h.step(None)
            numbers.append(h.round.number if h.round is not None else None)
        clock.advance(0.5)
        a._beat()  # the keep-alive threads
        b._beat()
    assert all(n is None or n > 1 for n in numbers), numbers
    act_a, act_b = a.step(None), b.step(None)
    assert isinstance(act_a, Run) and isinstance(act_b, Run)
    assert act_a.round == act_b.round and act_a.round.number == 2
    assert act_a.round.member_ids == ["a", "b"]  # waited for both to re-register


def test_a_restored_round_brings_back_its_master_address() -> None:
    """A running agent restores its round after a store restart; a member that had not
    read the master address yet must still find it, or it waits for ever."""
    clock, store, a, b = _two_agents(min_nodes=1, max_nodes=2)
    a.step(None)
    act = a.step(None)
    assert isinstance(act, Run) and act.round.member_ids == ["a", "b"]
    master = a.master_for(act.round, timeout_s=0)  # a is rank 0 and runs round 1
    assert master is not None
    b.step(None)
    _wipe(store)
    a.step(1)  # restores round 1
    assert isinstance(b.step(None), Run)
    assert b.master_for(act.round, timeout_s=0) == master


def test_an_old_idle_agent_is_not_timed_out_by_the_settle_after_a_store_restart() -> None:
    clock, store, a, b = _two_agents(min_nodes=2, max_nodes=2, join_timeout_s=10)
    a.step(None)
    assert isinstance(b.step(None), Run)
    clock.advance(60)  # a and b have been up for longer than the join timeout
    a._beat()
    b._beat()
    _wipe(store)
    assert isinstance(a.step(None), Wait)  # settling, not a RendezvousTimeout


def test_a_failure_reported_after_a_store_restart_lost_the_round_is_not_a_crash() -> None:
    """Chaos finding: a worker failed just as the store restarted; report_failure found no
    round and the agent died on an assertion. Now the next round forms above the old one
    once the nodes re-register."""
    clock, store, a, b = _two_agents(min_nodes=1, max_nodes=2)
    a.step(None)
    act = b.step(None)
    assert isinstance(act, Run) and act.round.number == 1
    a.step(None)
    _wipe(store)
    rec = a.report_failure(1, FailureCause(rank=0, exit_code=1))
    assert rec.number >= 1
    assert a.count_failure(FailureCause(rank=0, exit_code=1)).number >= 1
    for _ in range(10):
        for h in (a, b):
            h.step(None)
        clock.advance(0.5)
        a._beat()
        b._beat()
    act_a, act_b = a.step(None), b.step(None)
    assert isinstance(act_a, Run) and act_a.round == getattr(act_b, "round", None)
    assert act_a.round.number > 1 and act_a.round.member_ids == ["a", "b"]


def test_an_agent_whose_own_keep_alive_lapsed_does_not_declare_itself_lost() -> None:
    """Seen under heavy load: a standalone agent's keep-alive thread was starved for more
    than the TTL, and the agent proposed a round without itself (node_lost of its own id),
    restarting its healthy workers. An agent that steps is alive; only others judge it."""
    clock, store, a, b = _two_agents(min_nodes=1, max_nodes=2)
    a.step(None)
    act = a.step(None)
    assert isinstance(act, Run) and act.round.member_ids == ["a", "b"]
    for _ in range(8):  # b keeps beating; a's keep-alive thread is starved
        clock.advance(0.5)
        b._beat()
    act = a.step(1)
    assert act == Wait("training") and _round(store).number == 1
    act = b.step(1)  # b, on the other hand, sees a gone
    assert isinstance(act, Wait) and _round(store).number == 2
    assert _round(store).member_ids == ["b"]


def _round(store: MemoryStore) -> RoundRecord:
    entry = store.get(Keys("job").round)
    assert entry is not None
    return RoundRecord.decode(entry.value)


TCP_S = RendezvousSettings(
    min_nodes=1, max_nodes=3, last_call_s=0, heartbeat_interval_s=1, heartbeat_timeout_s=3
)


def _join(port: int, node: str, clock: FakeClock) -> RendezvousHandler:
    return _handler(
        TcpStore("127.0.0.1", port, connect_timeout_s=5, clock=clock), node, clock, TCP_S
    )


def _settle(h: RendezvousHandler, running: int | None) -> Run:
    for _ in range(5):
        act = h.step(running)
        if isinstance(act, Run):
            return act
    raise AssertionError(f"{h.me.node_id} did not get a round: {act}")


@pytest.mark.timeout(60)
def test_a_node_joining_after_a_kill_does_not_start_a_round_storm() -> None:
    """Chaos finding: n1 was killed; n2 dropped it (node_lost); n3, started just then,
    first saw n1's last keep-alive and counted it alive for a full TTL: n3 proposed rounds
    with n1 (scale_up), n2 dropped it again (node_lost): ~70 rounds in 2 s."""
    clock = FakeClock()
    server = TcpStoreServer("127.0.0.1", 0)
    hs: list[RendezvousHandler] = []
    try:
        n1, n2 = _join(server.port, "n1", clock), _join(server.port, "n2", clock)
        hs += [n1, n2]
        r1 = _settle(n1, None).round
        assert _settle(n2, None).round == r1 and r1.member_ids == ["n1", "n2"]
        clock.advance(1.0)
        n1._beat()  # n1's last keep-alive, then kill -9
        for _ in range(6):  # n2 judges n1's keep-alive stale 3 s after it first saw it
            clock.advance(1.0)
            n2._beat()
            n2.step(r1.number)
        r2 = _settle(n2, r1.number).round  # n2 noticed: round without n1
        assert r2.member_ids == ["n2"] and r2.reason == "node_lost"
        n3 = _join(server.port, "n3", clock)  # its client sees n1's keep-alive for the 1st time
        hs.append(n3)
        rounds = set()
        running = {"n2": r2.number, "n3": None}
        for _ in range(6):  # the two nodes step in turn within one TTL
            for h in (n3, n2):
                act = h.step(running[h.me.node_id])
                if isinstance(act, Run):
                    running[h.me.node_id] = act.round.number
                    rounds.add(act.round.number)
                assert h.round is not None and "n1" not in h.round.member_ids, h.round
            clock.advance(0.1)
        assert len(rounds) == 1, f"rounds kept changing: {sorted(rounds)}"
        assert n2.round is not None and n2.round.member_ids == ["n2", "n3"]
        # n1 comes back for real (a new agent beating): it is taken in once seen renewed.
        n1._beat()
        n1.store.put(n1.keys.node("n1"), n1.me.encode())
        clock.advance(1.0)
        n1._beat()
        for h in (n2, n3):
            h._beat()
        act = _settle(n1, None)
        assert act.round.member_ids == ["n2", "n3", "n1"]
    finally:
        for h in hs:
            h.store.close()
        server.close()
