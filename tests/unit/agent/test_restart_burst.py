"""Restart mode in a burst of failures: the round's ranks share one wait for booting warm
spares (a loaded node found every spare still booting and waited once per rank)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_runners import MASTER, FakePool, restart_runner, rnd

from flexrun.agent.restart import SPARE_BOOT_WAIT_S
from flexrun.proc import Worker
from flexrun.testing import FakeClock


class SlowPool(FakePool):
    """Every spare is still booting: each take waits 6 s (of the fake clock) for one."""

    clock: FakeClock

    def __init__(self, tmp: Path) -> None:
        super().__init__(tmp)
        self.waits: list[float] = []

    def take(self, wait_s: float = 0.0) -> Worker | None:
        self.waits.append(wait_s)
        self.clock.advance(min(wait_s, 6.0))
        return super().take()


@pytest.mark.timeout(20)
def test_the_ranks_of_a_round_share_one_wait_for_booting_spares(tmp_path: Path) -> None:
    pool = SlowPool(tmp_path)
    runner, _ = restart_runner(tmp_path, pool)
    pool.clock = runner.clock  # type: ignore[assignment]
    runner.run_round(rnd(1, ("n1", 2)), MASTER)
    assert pool.waits == [SPARE_BOOT_WAIT_S, SPARE_BOOT_WAIT_S - 6.0]
    runner.stop(0)
