"""The interleaving check on live-mode step logs, whose ``round`` is the membership epoch.

A live fallback (every member died; the next epoch restores the durable checkpoint and
redoes steps) is numbered above the epoch it replaces, also after a store restart (the
agents publish the lost epoch again above the newest they saw:
tests/integration/test_live_outage.py), so it is not interleaving; a member of an old
epoch that logs after the new epoch began still is."""

from __future__ import annotations

from flexrun.testing import invariants as inv


def _line(step: int, epoch: int, rank: int, world: int, ts: float, pid: int) -> dict:
    return {
        "t0": ts - 0.05, "ts": ts, "round": epoch, "world": world, "rank": rank,
        "step": step, "epoch": 0, "ids": [step * 10 + rank], "pid": pid,
    }  # fmt: skip


def _fallback_run() -> list[dict]:
    """Epoch 3 trains steps 489-491 at world 2; every member dies; epoch 4 (fresh workers)
    restores the checkpoint of step 480 and trains 481-483."""
    recs = []
    ts = 100.0
    for step in (489, 490, 491):
        recs += [_line(step, 3, 0, 2, ts, 11), _line(step, 3, 1, 2, ts, 12)]
        ts += 0.1
    ts += 5.0  # the fallback: new processes, the checkpoint
    for step in (481, 482, 483):
        recs += [_line(step, 4, 0, 2, ts, 21), _line(step, 4, 1, 2, ts, 22)]
        ts += 0.1
    return recs


def test_a_live_fallback_to_the_checkpoint_is_not_interleaving() -> None:
    result = inv.CheckResult()
    inv.check_rounds(_fallback_run(), result)
    assert not result.failed("rounds_never_interleave"), result.violations
    assert result.stats["rounds"] == 2


def test_a_member_of_an_old_epoch_logging_after_the_new_one_began_is_interleaving() -> None:
    recs = [*_fallback_run(), _line(492, 3, 1, 2, 106.0, 12)]  # epoch 3 still at work
    result = inv.CheckResult()
    inv.check_rounds(recs, result)
    assert result.failed("rounds_never_interleave")
    assert any("round 3" in v.detail and "round 4" in v.detail for v in result.violations)
