"""The agent's failure policy, driven with hand-made events and a fake ``now``.

Each failure path the integration tests exercise with real processes has its decision
here: a clean finish, a script error, an echo of a peer's death (one node: wait for the
real cause; several nodes: follow the round the lost peer causes, or count it once the
wait is over), a store that lost the round, live mode's once-per-epoch counting, hangs.
"""

from __future__ import annotations

from flexrun.agent import policy as p
from flexrun.cause import FailureCause

S = p.PolicySettings(cause_wait_s=1.0, stop_grace_s=2.0, settle_s=12.0)


def ok(rank: int, at: float = 0.0) -> p.WorkerExit:
    return p.WorkerExit(rank, 0, at)


def failed(rank: int, at: float = 0.0, *, echo: bool = False, code: int = 1) -> p.WorkerExit:
    msg = "RuntimeError: Connection closed by peer" if echo else f"ValueError: rank {rank}"
    cause = FailureCause(rank=rank, exit_code=code, message=msg, node="n1")
    return p.WorkerExit(rank, code, at, cause=cause, consequence=echo)


def exited(*exits: p.WorkerExit, done: bool, peers: int = 1) -> p.Exited:
    return p.Exited(tuple(exits), done, peers)


def kinds(d: p.Decision) -> list[type]:
    return [type(a) for a in d.actions]


def test_starting_workers_enters_training_of_that_round() -> None:
    d = p.step(p.Idle(), p.Started(3), 0.0, S)
    assert d.phase == p.Training(3) and d.actions == ()


def test_all_workers_ending_zero_finishes_the_job() -> None:
    d = p.step(p.Training(3), exited(ok(0), ok(1), done=True), 5.0, S)
    assert isinstance(d.phase, p.Idle)
    assert kinds(d) == [p.EmitExits, p.StopWorkers, p.Finish]
    stop = d.actions[1]
    assert isinstance(stop, p.StopWorkers) and stop.productive and stop.grace_s == 0
    assert d.actions[2] == p.Finish(3)


def test_some_workers_done_and_none_failed_keeps_training() -> None:
    d = p.step(p.Training(3), exited(ok(0), done=False), 5.0, S)
    assert d.phase == p.Training(3) and d.actions == ()


def test_a_script_error_stops_the_workers_and_reports_the_failure_at_once() -> None:
    d = p.step(p.Training(2), exited(failed(1, 10.0), done=False, peers=2), 10.0, S)
    assert isinstance(d.phase, p.Reporting) and d.phase.round == 2
    assert kinds(d) == [p.EmitExits, p.StopWorkers, p.Report]
    stop, report = d.actions[1], d.actions[2]
    assert isinstance(stop, p.StopWorkers) and not stop.productive and stop.grace_s == 2.0
    assert isinstance(report, p.Report) and report.round == 2 and not report.live
    assert report.cause.rank == 1 and report.cause.round == 2


def test_an_echo_on_one_node_waits_for_the_real_cause_then_blames_the_real_error() -> None:
    d = p.step(p.Training(1), exited(failed(0, 10.0, echo=True), done=False), 10.0, S)
    assert d.phase == p.AwaitingCause(1, 11.0) and d.actions == ()
    # Still only echoes, before the deadline: keep waiting.
    d = p.step(d.phase, exited(failed(0, 10.0, echo=True), done=False), 10.5, S)
    assert isinstance(d.phase, p.AwaitingCause) and d.actions == ()
    # The rank that raised ends, a few ms after its echo: it is the root cause.
    d = p.step(
        d.phase,
        exited(failed(0, 10.0, echo=True), failed(2, 10.002), done=False),
        10.6,
        S,
    )
    assert isinstance(d.phase, p.Reporting)
    report = d.actions[-1]
    assert isinstance(report, p.Report) and report.cause.rank == 2


def test_an_echo_alone_is_reported_once_the_cause_wait_is_over() -> None:
    phase = p.AwaitingCause(1, 11.0)
    d = p.step(phase, exited(failed(0, 10.0, echo=True), done=False), 11.0, S)
    assert isinstance(d.phase, p.Reporting) and kinds(d)[-1] is p.Report


def test_an_echo_is_concluded_as_soon_as_every_worker_has_ended() -> None:
    phase = p.AwaitingCause(1, 11.0)
    d = p.step(phase, exited(failed(0, 10.0, echo=True), ok(1), done=True), 10.1, S)
    assert isinstance(d.phase, p.Reporting)


def test_an_echo_in_a_multi_node_job_settles_and_follows_the_round_a_lost_peer_causes() -> None:
    d = p.step(p.Training(4), exited(failed(0, 9.0, echo=True), done=True, peers=2), 10.0, S)
    assert d.phase == p.Settling(4, d.phase.cause, 22.0)  # type: ignore[union-attr]
    assert kinds(d) == [p.EmitExits, p.StopWorkers]  # not reported yet
    still = p.step(d.phase, p.RoundSeen(4), 15.0, S)
    assert still.phase == d.phase and still.actions == ()
    moved = p.step(d.phase, p.RoundSeen(5), 16.0, S)
    assert isinstance(moved.phase, p.Idle) and kinds(moved) == [p.Follow]


def test_a_settling_failure_is_counted_when_the_round_does_not_move_in_time() -> None:
    phase = p.Settling(4, FailureCause(rank=0, message="reset by peer"), 22.0)
    d = p.step(phase, p.RoundSeen(4), 22.0, S)
    assert isinstance(d.phase, p.Reporting) and kinds(d) == [p.Report]


def test_a_store_outage_while_settling_restarts_the_wait_from_when_the_store_is_back() -> None:
    # The lost peer's keep-alive can only expire once the store answers again (etcd renews
    # leases when it restarts): the wait must not run out while the store was away.
    phase = p.Settling(4, FailureCause(rank=0, message="reset by peer"), 22.0)
    back = p.step(phase, p.StoreBack(), 20.0, S)
    assert back.phase == p.Settling(4, phase.cause, 20.0 + S.settle_s) and not back.actions
    assert isinstance(p.step(back.phase, p.RoundSeen(4), 23.0, S).phase, p.Settling)
    moved = p.step(back.phase, p.RoundSeen(5), 25.0, S)
    assert isinstance(moved.phase, p.Idle) and kinds(moved) == [p.Follow]
    # A longer wait is kept; in any other phase the store's return changes nothing.
    assert p.step(p.Settling(4, phase.cause, 99.0), p.StoreBack(), 20.0, S).phase.until == 99.0  # type: ignore[union-attr]
    assert p.step(p.Training(4), p.StoreBack(), 20.0, S) == p.Decision(p.Training(4))


def test_a_store_that_lost_the_round_while_settling_is_followed_not_counted() -> None:
    phase = p.Settling(4, FailureCause(rank=0), 22.0)
    d = p.step(phase, p.RoundSeen(None), 12.0, S)
    assert isinstance(d.phase, p.Idle) and kinds(d) == [p.Follow]


def test_a_preempted_peer_stop_with_exit_143_settles_instead_of_counting() -> None:
    cause = FailureCause(rank=0, exit_code=143, message="exited with code 143")
    ex = p.WorkerExit(0, 143, 1.0, cause=cause, consequence=True)
    d = p.step(p.Training(2), exited(ex, done=True, peers=3), 2.0, S)
    assert isinstance(d.phase, p.Settling)


def test_an_echo_on_one_node_is_never_settled_there_is_no_peer_to_follow() -> None:
    d = p.step(p.Training(1), exited(failed(0, 1.0, echo=True), done=True, peers=1), 1.0, S)
    assert isinstance(d.phase, p.Reporting)


def test_reporting_ends_when_the_rendezvous_takes_it_and_survives_a_halt() -> None:
    phase = p.Reporting(2, FailureCause(rank=0))
    assert p.step(phase, p.Halted(), 0.0, S).phase == phase  # (an outage: retried)
    assert isinstance(p.step(phase, p.Reported(), 0.0, S).phase, p.Idle)


def test_halted_workers_leave_training() -> None:
    assert isinstance(p.step(p.Training(2), p.Halted(), 0.0, S).phase, p.Idle)


def test_hold_round_is_the_round_a_node_still_belongs_to() -> None:
    cause = FailureCause()
    assert p.hold_round(p.Idle()) is None
    assert p.hold_round(p.Training(3)) == 3
    assert p.hold_round(p.AwaitingCause(3, 1.0)) == 3
    assert p.hold_round(p.Settling(3, cause, 1.0)) == 3
    assert p.hold_round(p.Reporting(3, cause)) is None


def test_events_that_do_not_apply_to_a_phase_change_nothing() -> None:
    for phase in (p.Idle(), p.Settling(1, FailureCause(), 5.0)):
        d = p.step(phase, exited(failed(0), done=True), 1.0, S)
        assert d.phase == phase and d.actions == ()
    d = p.step(p.Training(1), p.RoundSeen(7), 1.0, S)
    assert d.phase == p.Training(1) and d.actions == ()


def test_first_failure_prefers_a_real_error_among_near_simultaneous_ones() -> None:
    echo, real = failed(0, 10.0, echo=True), failed(1, 10.3)
    assert p.first_failure([echo, real]) is real
    later = failed(2, 12.0)  # more than SIMULTANEOUS_S after the first: not a candidate
    assert p.first_failure([echo, later]) is echo
    assert p.first_failure([failed(3, 5.0), failed(4, 4.0)]).rank == 4


# -- live mode ----------------------------------------------------------------------------------
def live_failed(epoch: int, *ranks: int) -> p.LiveFailed:
    return p.LiveFailed(tuple(FailureCause(rank=r, worker_id=f"w{r}") for r in ranks), epoch)


def test_live_failures_are_counted_once_per_epoch() -> None:
    d = p.step(p.Training(1), live_failed(3, 0, 1), 0.0, S)
    assert d.phase == p.Training(1, counted_epoch=3)
    (report,) = d.actions
    assert isinstance(report, p.Report) and report.live and report.cause.worker_id == "w0"
    again = p.step(d.phase, live_failed(3, 2), 0.1, S)
    assert again.phase == d.phase and again.actions == ()
    later = p.step(d.phase, live_failed(4, 2), 0.2, S)
    assert later.phase == p.Training(1, counted_epoch=4) and kinds(later) == [p.Report]


def test_a_new_round_keeps_the_counted_epoch_in_live_mode() -> None:
    d = p.step(p.Training(1, counted_epoch=3), p.Started(2), 0.0, S)
    assert d.phase == p.Training(2, counted_epoch=3)
    assert p.step(d.phase, live_failed(3, 0), 0.0, S).actions == ()


def test_live_workers_finishing_finishes_the_job() -> None:
    d = p.step(p.Training(5), p.LiveFinished(), 0.0, S)
    assert isinstance(d.phase, p.Idle) and kinds(d) == [p.StopWorkers, p.Finish]
    assert d.actions[-1] == p.Finish(5)


# -- hangs ----------------------------------------------------------------------------------------
def test_a_hang_blames_the_rank_stuck_outside_a_collective() -> None:
    silent = {0: 30.0, 1: 12.0, 2: 31.0}
    waiting = {0: True, 1: False, 2: True}  # 0 and 2 wait in an all-reduce for rank 1
    assert p.blame_hang(silent, waiting) == 1


def test_a_hang_with_every_rank_in_a_collective_blames_the_longest_silent() -> None:
    assert p.blame_hang({0: 5.0, 1: 9.0}, {0: True, 1: True}) == 1


def test_a_hang_blames_the_rank_outside_a_collective_that_has_not_reached_its_limit_yet() -> None:
    # Found on a loaded machine: rank 1 hung in its step a moment after reporting the step
    # rank 0 reported last, so only rank 0 (in the all-reduce, waiting for it) was past the
    # limit when the agent looked; it was blamed and killed as the hung one.
    silent = {0: 3.0}
    waiting = {0: True, 1: False}
    assert p.blame_hang(silent, waiting, {0: 3.0, 1: 2.95}) == 1
    # a rank outside a collective that has just made progress is not the one stuck
    assert p.blame_hang(silent, waiting, {0: 3.0, 1: 0.2}) == 0
    # nor is a rank whose stacks could not be read (unknown, not "outside")
    assert p.blame_hang(silent, {0: True}, {0: 3.0, 1: 2.95}) == 0


def test_settings_follow_the_heartbeat_timing() -> None:
    from flexrun.config import RendezvousSettings

    s = p.PolicySettings.from_rendezvous(
        RendezvousSettings(heartbeat_interval_s=1.0, heartbeat_timeout_s=5.0)
    )
    assert s.settle_s == 12.0 and s.cause_wait_s == p.CAUSE_WAIT_S
