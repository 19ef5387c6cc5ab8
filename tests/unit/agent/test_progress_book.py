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
