"""plan_recovery: whose state a new live epoch takes, and when live state cannot be used."""

from __future__ import annotations

from flexrun.train.live_plan import MemberReport, plan_recovery


def test_survivors_keep_their_state_and_a_replacement_gets_the_lowest_ranked_holders() -> None:
    plan = plan_recovery(
        [MemberReport(7, True, "a"), MemberReport(7, True, "a"), MemberReport(0, False)],
        formed=True,
    )
    assert (plan.source, plan.transfer, plan.load_durable, plan.fallback) == (0, True, False, None)


def test_a_member_one_step_behind_is_normal_and_takes_the_state_of_one_ahead() -> None:
    plan = plan_recovery([MemberReport(6, True, "x"), MemberReport(7, True, "b")], formed=True)
    assert (plan.source, plan.transfer, plan.fallback) == (1, True, None)


def test_identical_members_need_no_transfer() -> None:
    plan = plan_recovery([MemberReport(3, True, "s")] * 3, formed=True)
    assert not plan.transfer and plan.fallback is None


def test_nobody_holding_state_after_an_epoch_formed_falls_back_to_the_checkpoint() -> None:
    plan = plan_recovery([MemberReport(0, False)] * 4, formed=True)
    assert plan.load_durable and plan.transfer and plan.source == 0
    assert plan.fallback is not None and "every worker" in plan.fallback


def test_the_first_epoch_of_a_job_is_a_resume_not_a_fallback() -> None:
    plan = plan_recovery([MemberReport(0, False)] * 2, formed=False)
    assert plan.load_durable and plan.fallback is None


def test_different_checksums_at_the_same_step_fall_back_to_the_checkpoint() -> None:
    plan = plan_recovery(
        [MemberReport(9, True, "a"), MemberReport(9, True, "z"), MemberReport(9, True, "a")],
        formed=True,
    )
    assert plan.load_durable and plan.transfer and plan.source == 0
    assert plan.fallback is not None and "checksum" in plan.fallback


def test_committed_steps_more_than_one_apart_fall_back_to_the_checkpoint() -> None:
    plan = plan_recovery([MemberReport(9, True, "a"), MemberReport(5, True, "b")], formed=True)
    assert plan.load_durable and plan.fallback is not None and "[5] vs 9" in plan.fallback


def test_a_lone_member_never_broadcasts() -> None:
    assert not plan_recovery([MemberReport(0, False)], formed=True).transfer
