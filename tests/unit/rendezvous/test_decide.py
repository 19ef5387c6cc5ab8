"""The pure membership rules, driven by hand-made views and a fake clock."""

from __future__ import annotations

from flexrun.cause import FailureCause
from flexrun.config import RendezvousSettings
from flexrun.rendezvous.decide import (
    Exit,
    Propose,
    Run,
    Stop,
    View,
    Wait,
    decide,
    next_round,
    order_members,
)
from flexrun.rendezvous.state import (
    CLOSED,
    FAILED,
    PENDING,
    RUNNING,
    Member,
    NodeRecord,
    RoundRecord,
)
from flexrun.testing import FakeClock

S = RendezvousSettings(min_nodes=1, max_nodes=3, last_call_s=2.0, max_restarts=1)


def alive(*ids: str) -> dict[str, tuple[NodeRecord, int]]:
    return {n: (NodeRecord(n, "127.0.0.1", 2), i + 1) for i, n in enumerate(ids)}


def rnd(number: int, *members: str, state: str = RUNNING, restarts: int = 0) -> RoundRecord:
    return RoundRecord(number, state, tuple(Member(m, "127.0.0.1", 2) for m in members), restarts)


def view(
    me: str,
    r: RoundRecord | None,
    nodes: dict,
    clock: FakeClock,
    since: float,
    running: int | None = None,
    registered: set[str] | None = None,
) -> View:
    return View(
        me=me,
        round=r,
        alive=nodes,
        registered=frozenset(registered if registered is not None else nodes),
        running=running,
        now=clock.monotonic(),
        candidates_since=since,
    )


def test_a_lone_joiner_waits_only_the_last_call_window_then_starts() -> None:
    clock = FakeClock()
    t0 = clock.monotonic()
    assert isinstance(decide(view("a", None, alive("a"), clock, t0), S), Wait)
    clock.advance(1.9)
    assert isinstance(decide(view("a", None, alive("a"), clock, t0), S), Wait)
    clock.advance(0.2)
    act = decide(view("a", None, alive("a"), clock, t0), S)
    assert isinstance(act, Propose) and act.record.member_ids == ["a"] and act.record.number == 1


def test_a_first_round_waits_for_the_expected_nodes_past_the_last_call() -> None:
    # A Slurm step's two tasks (srun may start the second seconds after the first).
    s = RendezvousSettings(min_nodes=1, max_nodes=3, last_call_s=1.0, expected_nodes=2)
    clock = FakeClock()
    t0 = clock.monotonic()
    clock.advance(29.9)
    act = decide(view("a", None, alive("a"), clock, t0), s)
    assert isinstance(act, Wait) and "1 of 2 present" in act.reason
    # The second arrives: the window of the last call (not of the expected wait) closes it.
    t1 = clock.monotonic()
    assert isinstance(decide(view("a", None, alive("a", "b"), clock, t1), s), Wait)
    clock.advance(1.0)
    act = decide(view("a", None, alive("a", "b"), clock, t1), s)
    assert isinstance(act, Propose) and act.record.member_ids == ["a", "b"]


def test_an_expected_node_that_never_comes_costs_the_expected_wait_once() -> None:
    s = RendezvousSettings(min_nodes=1, max_nodes=2, expected_nodes=2, expected_wait_s=30.0)
    clock = FakeClock()
    t0 = clock.monotonic()
    clock.advance(30.0)
    act = decide(view("a", None, alive("a"), clock, t0), s)
    assert isinstance(act, Propose) and act.record.member_ids == ["a"]
    # Later rounds (a node lost, one that joins) keep the last call alone.
    r = rnd(2, "a", state=PENDING)
    t1 = clock.monotonic()
    clock.advance(1.0)
    assert isinstance(decide(view("a", r, alive("a"), clock, t1), s), Propose)


def test_expected_nodes_above_max_wait_only_for_max() -> None:
    s = RendezvousSettings(min_nodes=1, max_nodes=2, expected_nodes=3)
    clock = FakeClock()
    act = decide(view("a", None, alive("a", "b"), clock, clock.monotonic()), s)
    assert isinstance(act, Propose) and act.record.member_ids == ["a", "b"]


def test_max_nodes_present_starts_at_once() -> None:
    clock = FakeClock()
    act = decide(view("a", None, alive("a", "b", "c"), clock, clock.monotonic()), S)
    assert isinstance(act, Propose) and act.record.member_ids == ["a", "b", "c"]


def test_too_few_nodes_wait_for_min() -> None:
    clock = FakeClock()
    s = RendezvousSettings(min_nodes=2, max_nodes=2, last_call_s=0)
    clock.advance(100)
    assert isinstance(decide(view("a", None, alive("a"), clock, 0), s), Wait)


def test_a_member_runs_its_round_once() -> None:
    clock = FakeClock()
    r = rnd(1, "a", "b")
    assert decide(view("a", r, alive("a", "b"), clock, 0), S) == Run(r)
    assert isinstance(decide(view("a", r, alive("a", "b"), clock, 0, running=1), S), Wait)


def test_a_lost_member_triggers_a_round_of_the_survivors_in_their_order() -> None:
    clock = FakeClock()
    r = rnd(4, "c", "a", "b")
    act = decide(view("b", r, alive("a", "b"), clock, 0, running=4, registered={"a", "b", "c"}), S)
    assert isinstance(act, Propose)
    assert act.record.number == 5 and act.record.member_ids == ["a", "b"] and act.lost == ("c",)
    assert act.record.reason == "node_lost" and act.record.restarts == 0


def test_a_member_that_left_gracefully_is_reported_as_left() -> None:
    clock = FakeClock()
    act = decide(view("a", rnd(1, "a", "b"), alive("a"), clock, 0, running=1, registered={"a"}), S)
    assert isinstance(act, Propose) and act.left == ("b",) and act.record.reason == "node_left"


def test_join_assigns_stable_ranks_if_a_member_leaves() -> None:
    members = order_members(["x", "y", "z"], alive("z", "x", "new"), 3)
    assert [m.node_id for m in members] == ["x", "z", "new"]


def test_a_waiting_node_triggers_scale_up_after_the_last_call_window() -> None:
    clock = FakeClock()
    r = rnd(1, "a")
    since = clock.monotonic()
    nodes = alive("a", "b")
    assert isinstance(decide(view("a", r, nodes, clock, since, running=1), S), Wait)
    clock.advance(2.0)
    act = decide(view("a", r, nodes, clock, since, running=1), S)
    assert isinstance(act, Propose) and act.record.member_ids == ["a", "b"] and act.joined == ("b",)


def test_waiters_reaching_max_scale_up_without_waiting() -> None:
    clock = FakeClock()
    act = decide(
        view("a", rnd(1, "a"), alive("a", "b", "c"), clock, clock.monotonic(), running=1), S
    )
    assert isinstance(act, Propose) and act.record.member_ids == ["a", "b", "c"]


def test_a_full_round_keeps_extra_nodes_on_standby() -> None:
    clock = FakeClock()
    s = RendezvousSettings(min_nodes=1, max_nodes=2, last_call_s=0)
    act = decide(view("c", rnd(1, "a", "b"), alive("a", "b", "c"), clock, 0), s)
    assert isinstance(act, Wait) and "standby" in act.reason


def test_too_few_survivors_make_a_pending_round_and_members_stop() -> None:
    clock = FakeClock()
    s = RendezvousSettings(min_nodes=2, max_nodes=2)
    act = decide(
        view("a", rnd(1, "a", "b"), alive("a"), clock, 0, running=1, registered={"a", "b"}), s
    )
    assert isinstance(act, Propose) and act.record.state == PENDING
    pending = act.record
    assert isinstance(decide(view("a", pending, alive("a"), clock, 0, running=1), s), Stop)


def test_failures_count_restarts_and_fail_the_job_when_exhausted() -> None:
    r1 = rnd(1, "a")
    r2 = next_round(
        r1, alive("a"), S, "failure", failure=True, root_cause=FailureCause(exit_code=3)
    )
    assert r2.state == RUNNING and r2.restarts == 1
    r3 = next_round(
        r2, alive("a"), S, "failure", failure=True, root_cause=FailureCause(exit_code=3, rank=1)
    )
    assert r3.state == FAILED and r3.exit_code == 3
    act = decide(view("a", r3, alive("a"), FakeClock(), 0, running=None), S)
    assert (
        isinstance(act, Exit)
        and act.code == 3
        and act.root_cause is not None
        and act.root_cause.rank == 1
    )


def test_membership_changes_do_not_count_as_restarts() -> None:
    r = next_round(rnd(1, "a", "b", restarts=1), alive("a"), S, "node_lost")
    assert r.restarts == 1


def test_a_closed_job_lets_running_workers_finish_and_others_exit() -> None:
    closed = rnd(2, "a", state=CLOSED)
    assert isinstance(decide(view("a", closed, alive("a"), FakeClock(), 0, running=2), S), Wait)
    act = decide(view("b", closed, alive("a", "b"), FakeClock(), 0), S)
    assert isinstance(act, Exit) and act.code == 0


def test_records_round_trip_through_json() -> None:
    r = RoundRecord(
        3,
        RUNNING,
        (Member("a", "h", 2), Member("b", "h", 1)),
        1,
        "failure",
        0,
        FailureCause(rank=1),
    )
    assert RoundRecord.decode(r.encode()) == r
    assert r.world_size() == 3 and r.rank_base("b") == 2 and r.group_rank("b") == 1


def _restarted_view(
    r: RoundRecord | None, clock: FakeClock, *, floor: int, settle_until: float
) -> View:
    nodes = alive("a", "b")
    return View(
        me="a",
        round=r,
        alive=nodes,
        registered=frozenset(nodes),
        running=None,
        now=clock.monotonic(),
        candidates_since=clock.monotonic() - 10,
        settle_until=settle_until,
        floor=floor,
    )


def test_after_a_store_restart_the_next_round_is_numbered_above_the_last_one_seen() -> None:
    """Chaos finding: the store restarted while a node was joining (no agent running a
    round, so none restored it) and both agents formed "round 1" after round 165."""
    clock = FakeClock()
    settle = clock.monotonic() + 3
    act = decide(_restarted_view(None, clock, floor=165, settle_until=settle), S)
    assert isinstance(act, Wait)  # nodes re-register first
    clock.advance(3)
    act = decide(_restarted_view(None, clock, floor=165, settle_until=settle), S)
    assert isinstance(act, Propose) and act.expected_number == 0
    assert act.record.number == 166 and act.record.member_ids == ["a", "b"]


def test_a_round_numbered_below_one_already_seen_is_replaced_by_a_higher_one() -> None:
    """A node that never saw the old rounds formed round 1 on the restarted store."""
    clock = FakeClock()
    act = decide(_restarted_view(rnd(1, "b"), clock, floor=165, settle_until=0), S)
    assert isinstance(act, Propose) and act.expected_number == 1
    assert act.record.number == 166 and act.record.member_ids == ["b", "a"]


def test_next_round_never_numbers_below_the_floor() -> None:
    assert next_round(None, alive("a"), S, "start", floor=7).number == 8
    assert next_round(rnd(9, "a"), alive("a"), S, "failure", floor=7).number == 10


def _joiner_view(me: str, r: RoundRecord, clock: FakeClock, unconfirmed: set[str]) -> View:
    nodes = alive("n2", "n3", "n1")
    return View(
        me=me,
        round=r,
        alive=nodes,
        registered=frozenset(nodes),
        running=None if me == "n3" else r.number,
        now=clock.monotonic(),
        candidates_since=clock.monotonic() - 10,
        unconfirmed=frozenset(unconfirmed),
    )


def test_a_keep_alive_not_yet_seen_renewed_does_not_bring_a_lost_node_back() -> None:
    """Chaos finding (round storm): n1 was killed and dropped from the round by n2; n3,
    just started, first saw n1's last keep-alive and (on a store whose readers judge TTLs
    themselves) counted it alive for a full TTL, proposing scale-up with n1 while n2 kept
    dropping it again: ~70 rounds in 2 s. A non-member counts as a joiner only once this
    reader has seen its keep-alive renewed."""
    clock = FakeClock()
    act = decide(_joiner_view("n3", rnd(10, "n2"), clock, {"n1"}), S)
    assert isinstance(act, Propose) and act.record.member_ids == ["n2", "n3"]
    assert act.joined == ("n3",)
    # The next round (n2 and n3) is stable from n3's side while n1 stays unconfirmed.
    act = decide(_joiner_view("n3", rnd(11, "n2", "n3"), clock, {"n1"}), S)
    assert isinstance(act, Run)
    # Seen renewed (n1 is really back): it joins as usual.
    act = decide(_joiner_view("n3", rnd(11, "n2", "n3"), clock, set()), S)
    assert isinstance(act, Propose) and act.joined == ("n1",)


def test_an_unconfirmed_member_is_still_judged_by_its_keep_alive() -> None:
    """The rule excludes unconfirmed newcomers only: a member's keep-alive keeps it in its
    round (its loss is declared by whoever sees the keep-alive expire)."""
    clock = FakeClock()
    act = decide(_joiner_view("n3", rnd(11, "n2", "n1", "n3"), clock, {"n1", "n2"}), S)
    assert isinstance(act, Run) and act.round.number == 11
