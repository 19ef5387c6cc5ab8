"""The agent's reading of worker progress files, the calibrated hang rule and ETTR."""

from __future__ import annotations

import os
from pathlib import Path

from flexrun.agent.progress import HangLimits, ProgressBook
from flexrun.agent.uptime import Uptime
from flexrun.testing.clock import FakeClock


def _write(path: Path, steps: int, mtime: float) -> None:
    path.write_text(f"{steps} 0\n")
    os.utime(path, (mtime, mtime))


def test_no_hook_means_nothing_to_judge(tmp_path: Path) -> None:
    book = ProgressBook()
    book.reset({0: tmp_path / "p0"})
    book.update(0.0)
    limits = HangLimits.from_timeout(3.0)
    assert limits is not None
    assert book.made_progress() is None and book.silent(1e12, limits, {0}) == {}


def test_first_step_budget_then_a_limit_learned_from_steps(tmp_path: Path) -> None:
    p = tmp_path / "p0"
    book = ProgressBook()
    book.reset({0: p})
    limits = HangLimits.from_timeout(3.0)
    assert limits is not None and limits.first_step_s == 120.0
    _write(p, 0, 1000.0)
    book.update(0.0)
    assert book.made_progress() is False
    assert book.silent(1020.0, limits, {0}) == {}  # a 20 s first step is no hang
    assert 0 in book.silent(1121.0, limits, {0})  # stuck before any step, past 120 s
    for i in range(1, 20):  # steps of 1 s (the first one 30 s after start-up: not learned)
        _write(p, i, 1029.0 + i)
        book.update(float(i))
    rp = book.ranks[0]
    assert book.made_progress() is True and book.first_step_mono() == 1.0
    assert rp.step_time_s is not None and abs(rp.step_time_s - 1.0) < 1e-6
    assert rp.longest_gap_s == 1.0  # (the 30 s before the first step is start-up)
    assert rp.limit_s(limits) == 10.0  # 10 x the step time, above the 3 s floor
    assert book.silent(1048.0 + 9.0, limits, {0}) == {}
    assert 0 in book.silent(1048.0 + 11.0, limits, {0})
    assert book.silent(1048.0 + 11.0, limits, set()) == {}  # (only living ranks)
    assert HangLimits.from_timeout(0) is None
    p.write_text("19 3 end\n")  # destroy_process_group: teardown is not a hang
    book.update(20.0)
    assert book.silent(1e12, limits, {0}) == {} and book.made_progress() is True


def test_ettr_counts_only_from_the_first_step() -> None:
    clock = FakeClock()
    up = Uptime(clock)
    up.restart()
    clock.advance(100.0)
    up.stop(productive=True)  # hung in init_process_group: never a step
    assert up.total_s == 0.0
    up.restart()
    clock.advance(10.0)
    up.observe(clock.monotonic())
    clock.advance(5.0)
    up.stop(productive=True)
    assert up.total_s == 5.0


def test_a_failed_segment_counts_up_to_its_newest_resumable_checkpoint() -> None:
    clock = FakeClock()
    t0 = clock.monotonic()
    up = Uptime(clock)
    up.restart()
    clock.advance(10.0)
    up.observe(clock.monotonic())  # first step at 10
    clock.advance(30.0)
    up.stop(productive=False)  # failed at 40, no checkpoint said: all of it is redone
    assert up.total_s == 0.0
    up.restart()
    clock.advance(5.0)
    up.observe(clock.monotonic())  # first step at 45
    clock.advance(30.0)
    up.stop(productive=False, kept_until=t0 + 65.0)  # failed at 75; resumes from the state of 65
    assert up.total_s == 20.0
    up.restart()
    up.observe(clock.monotonic())
    up.stop(productive=False, kept_until=1e9)  # (never past the failure itself)
    assert up.total_s == 20.0


def test_overhead_is_what_a_fault_free_run_also_spends_outside_its_steps() -> None:
    clock = FakeClock()
    started = clock.monotonic()
    up = Uptime(clock)
    up.restart()
    clock.advance(4.0)
    up.observe(clock.monotonic())  # start-up: 4 s to the first step
    clock.advance(50.0)
    up.stop(productive=True)
    clock.advance(1.0)  # after the last segment: the agent's own wrap-up
    assert up.total_s == 50.0 and up.overhead_s(started) == 5.0  # a fault-free run: 1.0

    clock = FakeClock()
    started = clock.monotonic()
    up = Uptime(clock)
    up.restart()
    clock.advance(4.0)
    up.observe(clock.monotonic())
    clock.advance(20.0)
    up.stop(productive=False, kept_until=clock.monotonic() - 2.0)  # 2 s done again
    clock.advance(3.0)  # the restart: lost, not overhead (only the first segment's lead is)
    up.restart()
    clock.advance(1.0)
    up.observe(clock.monotonic())
    clock.advance(30.0)
    up.stop(productive=True)
    clock.advance(1.0)
    assert up.total_s == 18.0 + 30.0 and up.overhead_s(started) == 5.0
    assert clock.monotonic() - started - up.total_s - up.overhead_s(started) == 6.0  # 2+3+1 lost

    clock = FakeClock()
    started = clock.monotonic()
    up = Uptime(clock)
    up.restart()
    clock.advance(4.0)
    up.stop(productive=False)  # the first workers died before a step: all of it lost
    up.restart()
    clock.advance(2.0)
    up.observe(clock.monotonic())
    clock.advance(10.0)
    up.stop(productive=False)  # and the job ended in a failure: nothing after it is overhead
    clock.advance(1.0)
    assert up.total_s == 0.0 and up.overhead_s(started) == 0.0


def test_the_newest_checkpoint_every_saving_rank_said_gives_when_its_state_was_taken(
    tmp_path: Path,
) -> None:
    book = ProgressBook()
    book.reset({0: tmp_path / "p0", 1: tmp_path / "p1"})
    assert book.kept_until() is None
    for t, (s0, s1) in enumerate([(1, 1), (2, 2), (3, 3), (4, 4), (5, 5)], start=1):
        (tmp_path / "p0").write_text(f"{s0} 0 s2\n" if t >= 4 else f"{s0} 0\n")
        (tmp_path / "p1").write_text(f"{s1} 0\n")
        book.update(float(t))
    # rank 0 said at t=4 that the state after 2 steps (seen at t=2) can be resumed from;
    # rank 1 saves nothing (a rank-0 checkpoint): it does not hold the answer back
    assert book.ranks[0].saved == 2 and book.kept_until() == 2.0
    (tmp_path / "p1").write_text("6 0 s4\n")  # once it says one, the older of the two wins
    (tmp_path / "p0").write_text("6 0 s5 end\n")
    book.update(6.0)
    assert book.ranks[0].ended and book.kept_until() == 4.0  # rank 1's 4 steps: seen at t=4
    (tmp_path / "p1").write_text("7 0 s7\n")  # a count never seen before the save: not known
    book.update(7.0)
    assert book.ranks[1].saved_mono() == 7.0 and book.kept_until() == 5.0
