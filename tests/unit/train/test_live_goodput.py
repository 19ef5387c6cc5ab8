"""flexrun.train.live_goodput: what a live job's disruptions cost, judged from one worker's
commit times; and how the total travels (member reports, the heartbeat file)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from flexrun.live_protocol import MemberReport, holds_state, mark_state, reported_lost
from flexrun.train.live_goodput import MAX_WINDOW, LostTime


def commits(lost: LostTime, start: float, intervals: list[float]) -> float:
    t = start
    for dt in intervals:
        t += dt
        lost.committed(t)
    return t


def steady(n: int = 40, pace: float = 0.1) -> tuple[LostTime, float]:
    lost = LostTime()
    lost.committed(0.0)
    return lost, commits(lost, 0.0, [pace] * n)


def test_a_pause_and_the_steps_slowed_after_it_are_lost_and_nothing_else() -> None:
    lost, t = steady()
    lost.disrupted()
    # 1.0 s until the next commit (the pause and the step redone), then 10 steps at twice
    # the pace (a replacement booting beside the survivors), then the steady pace again.
    t = commits(lost, t, [1.0] + [0.2] * 10 + [0.1] * 20)
    assert lost.lost_s == pytest.approx(0.9 + 10 * 0.1)
    # Outside a window, slow steps (noise, a slow batch) never count.
    commits(lost, t, [0.3, 0.05, 0.5])
    assert lost.lost_s == pytest.approx(1.9)


def test_a_job_that_stays_slower_counts_one_window_at_most() -> None:
    lost, t = steady()
    lost.disrupted()
    commits(lost, t, [0.15] * (MAX_WINDOW + 100))  # (one worker fewer for good)
    assert lost.lost_s == pytest.approx(MAX_WINDOW * 0.05)


def test_nothing_is_judged_before_a_steady_pace_is_known() -> None:
    lost = LostTime()
    lost.disrupted()  # (the start: no commit yet)
    lost.committed(0.0)
    lost.committed(5.0)
    assert lost.lost_s == 0.0
    lost.disrupted()  # (one interval known: no pace to judge by)
    lost.committed(9.0)
    assert lost.lost_s == 0.0


def test_the_total_is_the_largest_any_member_reported() -> None:
    lost, _ = steady()
    lost.adopt(3.5)
    lost.adopt(1.0)
    assert lost.lost_s == 3.5


def test_member_reports_carry_the_total_and_refuse_what_is_not_a_duration() -> None:
    r = MemberReport(7, True, "abc", lost_s=2.25)
    assert MemberReport.decode(r.encode()) == r
    assert MemberReport.decode('{"step": 1, "has_state": false}').lost_s == 0.0
    for bad in ('"1"', "-1", "1e300", "true", "NaN", "[1]"):
        with pytest.raises(ValueError, match="lost_s"):
            MemberReport.decode(f'{{"step": 1, "has_state": true, "lost_s": {bad}}}')


def test_the_heartbeat_file_carries_state_and_total_and_garbage_reads_as_none(
    tmp_path: Path,
) -> None:
    hb = tmp_path / "w0.hb"
    assert reported_lost(hb) == 0.0 and not holds_state(hb)
    mark_state(hb, 1.5)
    assert holds_state(hb) and reported_lost(hb) == 1.5
    assert [p.name for p in tmp_path.iterdir()] == ["w0.hb"]  # (no temporary left)
    for text in ("state\n", "state\nlost x\n", "state\nlost nan\n", "state\nlost -2\n", ""):
        hb.write_text(text)
        assert reported_lost(hb) == 0.0
    assert not math.isnan(reported_lost(hb))
