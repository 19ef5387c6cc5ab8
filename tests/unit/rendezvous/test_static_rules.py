"""The static (fixed-size) job's membership rules, driven by hand-made views."""

from __future__ import annotations

from flexrun.config import RendezvousSettings
from flexrun.exitcodes import NODE_LOST
from flexrun.rendezvous.decide import Exit, Propose, Run, Stop, View, Wait
from flexrun.rendezvous.state import FAILED, PENDING, RUNNING, Member, NodeRecord, RoundRecord
from flexrun.rendezvous.static import decide_static

S = RendezvousSettings(
    min_nodes=2, max_nodes=2, max_restarts=1, heartbeat_timeout_s=3.0, static=True
)


def nodes(*spec: tuple[str, int]) -> dict[str, tuple[NodeRecord, int]]:
    """(node id, node rank) in join order."""
    return {n: (NodeRecord(n, "10.0.0.1", 2, rank=k), i + 1) for i, (n, k) in enumerate(spec)}


def world(*ids: str, number: int = 1, restarts: int = 0, state: str = RUNNING) -> RoundRecord:
    return RoundRecord(number, state, tuple(Member(m, "10.0.0.1", 2) for m in ids), restarts)


def view(
    me: str,
    r: RoundRecord | None,
    alive: dict[str, tuple[NodeRecord, int]],
    *,
    running: int | None = None,
    registered: set[str] | None = None,
) -> View:
    return View(
        me=me,
        round=r,
        alive=alive,
        registered=frozenset(registered if registered is not None else alive),
        running=running,
        now=100.0,
        candidates_since=100.0,  # no last-call window: a static world starts when whole
    )


def test_the_world_waits_for_every_node_rank_then_orders_members_by_rank() -> None:
    assert isinstance(decide_static(view("b", None, nodes(("b", 1))), S), Wait)
    a = decide_static(view("b", None, nodes(("b", 1), ("a", 0))), S)
    assert isinstance(a, Propose)
    assert a.record.member_ids == ["a", "b"] and a.record.state == RUNNING
    assert a.record.restarts == 0 and a.record.reason == "start"
    assert a.record.group_rank("a") == 0 and a.record.rank_base("b") == 2


def test_a_second_claim_of_a_rank_waits_and_does_not_complete_the_world() -> None:
    alive = nodes(("a", 0), ("a2", 0))
    a = decide_static(view("a", None, alive), S)
    assert isinstance(a, Wait) and "[1]" in a.reason
    a = decide_static(view("a", None, {**alive, **nodes(("x", 0), ("b", 1))}), S)
    assert isinstance(a, Propose) and a.record.member_ids == ["a", "b"]


def test_a_lost_node_fails_the_job_with_node_lost_naming_it() -> None:
    s = RendezvousSettings(min_nodes=2, max_nodes=2, max_restarts=0, static=True)
    r = world("a", "b", number=3)
    a = decide_static(view("a", r, nodes(("a", 0)), running=3, registered={"a", "b"}), s)
    assert isinstance(a, Propose) and a.lost == ("b",)
    assert a.record.state == FAILED and a.record.exit_code == NODE_LOST == 200
    cause = a.record.root_cause
    assert cause is not None and cause.node == "b" and cause.kind == "node_lost"
    assert "node rank 1" in cause.message and "lost" in cause.message
    # Every node then exits with 200 and that cause.
    e = decide_static(view("a", a.record, nodes(("a", 0)), running=3), s)
    assert isinstance(e, Exit) and e.code == 200 and e.root_cause == cause


def test_with_restarts_left_the_world_pauses_then_restarts_whole() -> None:
    r = world("a", "b", number=3)
    a = decide_static(view("a", r, nodes(("a", 0)), running=3, registered={"a", "b"}), S)
    assert isinstance(a, Propose)
    pending = a.record
    assert pending.state == PENDING and pending.restarts == 1 and pending.number == 4
    assert isinstance(decide_static(view("a", pending, nodes(("a", 0)), running=3), S), Stop)
    assert isinstance(decide_static(view("a", pending, nodes(("a", 0))), S), Wait)
    back = nodes(("a", 0), ("b-new", 1))
    a = decide_static(view("a", pending, back), S)
    assert isinstance(a, Propose)
    again = a.record
    assert again.state == RUNNING and again.member_ids == ["a", "b-new"]
    assert again.restarts == 1 and again.reason == "nodes_returned" and again.number == 5
    assert isinstance(decide_static(view("a", again, back), S), Run)
    # The next loss is past --max-restarts 1: the job ends.
    a = decide_static(view("a", again, nodes(("a", 0)), running=5, registered={"a", "b-new"}), S)
    assert isinstance(a, Propose) and a.record.state == FAILED and a.record.exit_code == 200


def test_a_graceful_leave_also_ends_the_static_world() -> None:
    s = RendezvousSettings(min_nodes=2, max_nodes=2, max_restarts=0, static=True)
    r = world("a", "b")
    a = decide_static(view("a", r, nodes(("a", 0)), running=1, registered={"a"}), s)
    assert isinstance(a, Propose) and a.left == ("b",) and a.record.exit_code == 200
    assert a.record.root_cause is not None and "left" in a.record.root_cause.message


def test_a_full_world_runs_and_an_extra_node_is_a_standby() -> None:
    r = world("a", "b")
    alive = nodes(("a", 0), ("b", 1), ("c", 1))
    assert isinstance(decide_static(view("a", r, alive), S), Run)
    assert isinstance(decide_static(view("a", r, alive, running=1), S), Wait)
    a = decide_static(view("c", r, alive), S)
    assert isinstance(a, Wait) and "standby" in a.reason


def test_an_unreachable_store_past_the_heartbeat_timeout_is_node_rank_0_lost() -> None:
    from flexrun.rendezvous.static import store_host_lost

    assert store_host_lost(1, "10.0.0.1:29500", 2.0, S) is None  # within the timeout
    assert store_host_lost(0, "10.0.0.1:29500", 60.0, S) is None  # node 0 hosts it itself
    cause = store_host_lost(1, "10.0.0.1:29500", 3.5, S)
    assert cause is not None and cause.exit_code == NODE_LOST and cause.kind == "node_lost"
    assert "node rank 0" in cause.message and "10.0.0.1:29500" in cause.message
