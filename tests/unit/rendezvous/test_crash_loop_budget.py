"""The restart-budget rules (flexrun.recovery, written into rounds by decide.py): crash loops (exit 86) and live mode's window."""

from __future__ import annotations

from flexrun.exitcodes import NO_PROGRESS
from flexrun.recovery import RecoverySettings
from flexrun.rendezvous.decide import counted_failure, failure_round
from flexrun.rendezvous.state import FAILED, RUNNING, Member, RoundRecord


def _round() -> RoundRecord:
    return RoundRecord(1, RUNNING, (Member("n1", "h", 2),), 0, "start")


def test_a_crash_loop_ends_with_86_after_k_restarts_without_a_step() -> None:
    s = RecoverySettings(max_restarts=100, crash_loop_restarts=3)
    r = _round()
    for _ in range(3):  # the first run and two restarts fail without a step: restart
        r = failure_round(r, s, None, progressed=False)
        assert r.state == RUNNING
    r = failure_round(r, s, None, progressed=False)  # the third restart failed too
    assert r.state == FAILED and r.exit_code == NO_PROGRESS and r.reason == "no_progress"


def test_progress_between_failures_resets_the_count() -> None:
    s = RecoverySettings(max_restarts=100, crash_loop_restarts=2)
    r = _round()
    for progressed in (False, False, True, False, False, None, False, False):
        r = failure_round(r, s, None, progressed=progressed)
        assert r.state == RUNNING, r
    assert r.stalled == 2 and r.restarts == 8


def test_crash_loop_control_off_and_restart_budget_first() -> None:
    r = _round()
    off = RecoverySettings(max_restarts=5, crash_loop_restarts=0)
    for _ in range(5):
        r = failure_round(r, off, None, progressed=False)
    r = failure_round(r, off, None, progressed=False)
    assert r.state == FAILED and r.reason == "restarts_exhausted"
    # torchrun's default budget (0) ends the job at its first failure, with its own code
    r = failure_round(_round(), RecoverySettings(max_restarts=0), None, progressed=False)
    assert r.reason == "restarts_exhausted"


def test_live_mode_counts_its_budget_per_window() -> None:
    s = RecoverySettings(max_restarts=2, restart_window_s=100.0)
    r = _round()
    r = counted_failure(r, s, None, now=1000.0)
    r = counted_failure(r, s, None, now=1050.0)
    assert r.state == RUNNING and r.restarts == 2
    assert counted_failure(r, s, None, now=1099.0).state == FAILED  # third in the window
    r = counted_failure(r, s, None, now=1100.0)  # the window ended: a new one opens
    assert r.state == RUNNING and r.restarts == 1 and r.window == 1100.0


def test_the_budget_fields_survive_the_header() -> None:
    r = failure_round(_round(), RecoverySettings(max_restarts=9), None, progressed=False)
    back = RoundRecord.decode(r.header())
    assert back.stalled == 1 and back.restarts == 1
