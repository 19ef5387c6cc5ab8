"""A static job's rendezvous end to end on the in-memory store with a fake clock: the
watcher and a follower, members ordered by node rank, a silent node failing the job."""

from __future__ import annotations

from flexrun.config import RendezvousSettings
from flexrun.events import EventLog
from flexrun.rendezvous import Exit, NodeRecord, RendezvousHandler, Run, Stop, Wait
from flexrun.store.memory import MemoryStore
from flexrun.testing import FakeClock


def settings(max_restarts: int) -> RendezvousSettings:
    return RendezvousSettings(
        min_nodes=2, max_nodes=2, heartbeat_interval_s=1, heartbeat_timeout_s=3,
        max_restarts=max_restarts, static=True,
    )  # fmt: skip


def handler(store: MemoryStore, node: str, rank: int, clock: FakeClock, s: RendezvousSettings):  # type: ignore[no-untyped-def]
    h = RendezvousHandler(
        store,
        run_id="job",
        me=NodeRecord(node, "127.0.0.1", 2, rank=rank),
        settings=s,
        events=EventLog(None, run_id="job", node=node),
        clock=clock,
    )
    h._beat()
    store.put(h.keys.node(node), h.me.encode())
    return h


def test_the_first_joiner_holding_rank_1_still_gets_group_rank_1() -> None:
    clock, s = FakeClock(), settings(0)
    store = MemoryStore(clock)
    b = handler(store, "b", 1, clock, s)  # joins first: it watches
    assert isinstance(b.step(None), Wait) and b.watching
    a = handler(store, "a", 0, clock, s)
    clock.advance(1)
    b._beat()
    a._beat()
    b.step(None)  # proposes [a, b]
    act_a, act_b = a.step(None), b.step(None)
    assert isinstance(act_a, Run) and isinstance(act_b, Run)
    assert act_a.round.group_rank("a") == 0 and act_b.round.group_rank("b") == 1
    assert act_b.round.rank_base("b") == 2 and act_b.round.restarts == 0


def test_a_silent_watcher_is_replaced_and_the_job_fails_with_node_lost() -> None:
    clock, s = FakeClock(), settings(0)
    store = MemoryStore(clock)
    b = handler(store, "b", 1, clock, s)
    b.step(None)
    a = handler(store, "a", 0, clock, s)
    clock.advance(1)
    b._beat()
    a._beat()
    b.step(None)
    assert isinstance(a.step(None), Run)
    silent_since = clock.monotonic()
    # b (the watcher) goes silent: a takes the role over and declares b lost.
    act = None
    for _ in range(12):
        clock.advance(0.5)
        a._beat()
        act = a.step(1)
        if isinstance(act, Exit):
            break
    assert isinstance(act, Exit) and act.code == 200, act
    assert act.root_cause is not None and act.root_cause.node == "b"
    assert "node rank 1" in act.root_cause.message
    # The heartbeat timeout plus a watcher take-over (half of it), and a step.
    assert clock.monotonic() - silent_since <= 3 + 1.5 + 0.5


def test_with_a_restart_left_the_survivor_stops_then_the_world_forms_again() -> None:
    clock, s = FakeClock(), settings(1)
    store = MemoryStore(clock)
    a = handler(store, "a", 0, clock, s)
    a.step(None)
    b = handler(store, "b", 1, clock, s)
    clock.advance(1)
    a._beat()
    b._beat()
    a.step(None)
    first = a.step(None)
    assert isinstance(first, Run) and isinstance(b.step(None), Run)
    act = None
    for _ in range(12):  # b is silent
        clock.advance(0.5)
        a._beat()
        act = a.step(first.round.number)
        if isinstance(act, Stop):
            break
    assert isinstance(act, Stop), act
    assert isinstance(a.step(None), Wait)
    b2 = handler(store, "b2", 1, clock, s)  # node rank 1 started again
    again = None
    for _ in range(8):
        clock.advance(0.5)
        a._beat()
        b2._beat()
        again = a.step(None)
        if isinstance(again, Run):
            break
    assert isinstance(again, Run), again
    assert again.round.member_ids == ["a", "b2"] and again.round.restarts == 1
    act_b2 = b2.step(None)
    assert isinstance(act_b2, Run) and act_b2.round.group_rank("b2") == 1


def test_node_rank_0_empties_the_workers_store_only_after_the_others_stopped_theirs() -> None:
    # A static job's one store: node rank 0 removes the earlier workers' keys only once every
    # other member has marked its earlier workers stopped, and publishes the master after.
    from flexrun.agent.worker_store import WorkerStores
    from flexrun.config import StaticJob

    clock, s = FakeClock(), settings(0)
    store = MemoryStore(clock)
    b = handler(store, "b", 1, clock, s)
    b.step(None)
    a = handler(store, "a", 0, clock, s)
    clock.advance(1)
    b._beat()
    a._beat()
    b.step(None)
    act_a, act_b = a.step(None), b.step(None)
    assert isinstance(act_a, Run) and isinstance(act_b, Run)
    emptied: list[int] = []

    def stores(h: RendezvousHandler, rank: int) -> WorkerStores:
        job = StaticJob(nnodes=2, node_rank=rank, master_addr="10.0.0.1", master_port=29500)
        return WorkerStores(job, h, timeout_s=0.0, empty=lambda: emptied.append(1) or 0)

    on_a, on_b = stores(a, 0), stores(b, 1)
    rnd = act_a.round
    assert on_a.for_round(rnd) is None and emptied == []  # b has not marked: wait on
    assert a.published_master(rnd.number) is None
    assert on_b.for_round(act_b.round) is None  # marked; no master yet
    master = on_a.for_round(rnd)
    assert master is not None and (master.addr, master.port) == ("10.0.0.1", 29500)
    assert emptied == [1] and a.published_master(rnd.number) is not None
    assert on_b.for_round(act_b.round) == master
    assert emptied == [1]  # (node rank 1 empties nothing)
