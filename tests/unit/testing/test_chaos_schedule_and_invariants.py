"""Unit tests of the chaos schedule (pure, seeded) and of the invariant checker on
synthetic step logs."""

from __future__ import annotations

import pytest

from flexrun.errors import ConfigError
from flexrun.testing import invariants as inv
from flexrun.testing.chaos import KINDS, make_schedule

SAMPLES, G = 8, 4  # two steps per epoch


def _line(step: int, rnd: int, rank: int, world: int, ids: list[int], ts: float) -> dict:
    return {
        "t0": ts - 0.1, "ts": ts, "round": rnd, "world": world, "rank": rank, "step": step,
        "epoch": (step - 1) * G // SAMPLES, "ids": ids, "pid": 100 * rnd + rank,
    }  # fmt: skip


def _clean_run() -> list[dict]:
    """4 steps at world 2; step 2 tried in round 0, then redone in round 1 after a failure."""
    return [
        _line(1, 0, 0, 2, [0, 1], 1.0), _line(1, 0, 1, 2, [2, 3], 1.0),
        _line(2, 0, 0, 2, [4, 5], 2.0),  # rank 1 died: this attempt never committed
        _line(2, 1, 0, 1, [4, 5, 6, 7], 5.0),
        _line(3, 1, 0, 1, [3, 1, 0, 2], 6.0),
        _line(4, 1, 0, 1, [7, 6, 5, 4], 7.0),
    ]  # fmt: skip


def test_the_same_seed_gives_the_same_schedule_and_another_seed_another() -> None:
    a = make_schedule(7, duration_s=300, interval_s=10)
    assert a == make_schedule(7, duration_s=300, interval_s=10)
    assert a != make_schedule(8, duration_s=300, interval_s=10)
    assert 20 <= len(a) <= 45
    assert all(f.kind in KINDS for f in a)
    assert [f.at_s for f in a] == sorted(f.at_s for f in a)
    assert all(f.at_s < 300 for f in a)


def test_a_schedule_uses_only_the_kinds_asked_for_and_rejects_unknown_ones() -> None:
    s = make_schedule(1, duration_s=100, interval_s=5, kinds=("kill_worker",))
    assert {f.kind for f in s} == {"kill_worker"}
    with pytest.raises(ConfigError):
        make_schedule(1, duration_s=100, interval_s=5, kinds=("unplug_datacenter",))
    with pytest.raises(ConfigError):
        make_schedule(1, duration_s=100, interval_s=0)


def test_a_redone_step_counts_once_the_last_attempt_wins() -> None:
    result = inv.CheckResult()
    inv.check_exactly_once(_clean_run(), steps=4, samples=SAMPLES, global_batch=G, result=result)
    inv.check_rounds(_clean_run(), result)
    assert result.ok, result.violations
    stats = inv.attempt_stats(_clean_run())
    assert stats["steps_recomputed"] == 1 and stats["steps_attempted"] == 5


def test_a_sample_consumed_twice_in_an_epoch_is_a_violation() -> None:
    recs = _clean_run()
    recs[-1] = _line(4, 1, 0, 1, [7, 6, 5, 5], 7.0)
    result = inv.CheckResult()
    inv.check_exactly_once(recs, steps=4, samples=SAMPLES, global_batch=G, result=result)
    assert result.failed("exactly_once")
    assert any("twice" in v.detail for v in result.violations)


def test_a_missing_step_or_a_missing_rank_is_a_violation() -> None:
    recs = [r for r in _clean_run() if r["step"] != 3]
    result = inv.CheckResult()
    inv.check_exactly_once(recs, steps=4, samples=SAMPLES, global_batch=G, result=result)
    assert any("never committed" in v.detail for v in result.violations)
    recs = [r for r in _clean_run() if not (r["step"] == 1 and r["rank"] == 1)]
    result = inv.CheckResult()
    inv.check_exactly_once(recs, steps=4, samples=SAMPLES, global_batch=G, result=result)
    assert any("one line per rank" in v.detail for v in result.violations)


def test_an_old_round_logging_after_a_newer_one_is_interleaving() -> None:
    recs = [*_clean_run(), _line(3, 0, 1, 2, [9], 6.5)]
    result = inv.CheckResult()
    inv.check_rounds(recs, result)
    assert result.failed("rounds_never_interleave")


def test_weights_compare_bitwise_at_one_world_size_and_relatively_across_sizes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import torch

    ref = {"w": torch.ones(4, dtype=torch.float64)}
    close = {"w": ref["w"] * (1 + 1e-9)}
    torch.save(ref, tmp_path / "ref.pt")
    torch.save(close, tmp_path / "close.pt")
    same = inv.CheckResult()
    inv.check_weights(tmp_path / "close.pt", tmp_path / "ref.pt", constant_world=True, result=same)
    assert same.failed("final_weights")
    resized = inv.CheckResult()
    inv.check_weights(
        tmp_path / "close.pt", tmp_path / "ref.pt", constant_world=False, result=resized
    )
    assert resized.ok


def test_a_resume_behind_a_committed_checkpoint_is_a_lost_checkpoint(tmp_path) -> None:  # type: ignore[no-untyped-def]
    events = [{"event": "checkpoint_saved", "step": 20, "ts": 10.0}]
    resumes = [{"resume": 10, "ts": 11.0, "pid": 5}]
    result = inv.CheckResult()
    inv.check_checkpoints(
        str(tmp_path), corrupted=set(), events=events, resumes=resumes, result=result
    )
    assert any("lost checkpoint" in v.detail for v in result.violations)
    result = inv.CheckResult()
    inv.check_checkpoints(
        str(tmp_path), corrupted={20}, events=events, resumes=resumes, result=result
    )
    assert not any("lost checkpoint" in v.detail for v in result.violations)


def test_the_stall_after_a_fault_spans_the_redone_steps_and_ignores_the_step_in_flight() -> None:
    # At 2.5 only step 1 is committed (step 2's first try at 2.0 was redone at 5.0): the
    # pause runs from step 1's end (1.0) to step 2's redo (5.0). At 6.5, step 4 (in flight,
    # committed at 7.0) ends the pause quickly; after 8.0 nothing commits.
    assert inv.stalls_after(_clean_run(), [6.5, 2.5, 8.0]) == [4.0, 1.0]


def test_the_last_faults_stall_window_ends_at_the_horizon() -> None:
    # A fault at 5.5, then a pause (a slow checkpoint, say) from 7.0 to 20.0 long after it:
    # unbounded, the last fault's window is the rest of the run and takes that pause; with a
    # 2 s horizon it sees only its own gaps (steps 3 and 4, a second apart).
    run = [*_clean_run(), _line(5, 1, 0, 1, [0, 1, 2, 3], 20.0)]
    assert inv.stalls_after(run, [5.5]) == [13.0]
    assert inv.stalls_after(run, [5.5], horizon_s=2.0) == [1.0]
    stats = inv.attempt_stats(_clean_run())
    assert (stats["first_step_t0"], stats["last_step_ts"]) == (0.9, 7.0)
    # Step 1 (0.9-1.0), step 2's redo opens round 1 (4.9-5.0), steps 3 and 4 follow it.
    assert stats["productive_cycle_s"] == pytest.approx(0.1 + 0.1 + 1.0 + 1.0)


def _shard_state(value: float) -> dict:
    import torch

    w = torch.full((2,), value, dtype=torch.float64)
    return {"model": {"w": w}, "optim": {0: {"step": torch.tensor(3.0), "exp_avg": w * 2}}}


def test_a_sharded_jobs_replicas_must_agree_bitwise_and_match_the_reference(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import torch

    final, ref = tmp_path / "final", tmp_path / "ref"
    final.mkdir()
    ref.mkdir()
    for shard, value in ((0, 1.0), (1, 2.0)):
        torch.save(_shard_state(value), ref / f"shard{shard}-1.pt")
        for pid in (10, 11):
            torch.save(_shard_state(value), final / f"shard{shard}-{pid}.pt")
    ok = inv.CheckResult()
    inv.check_shard_states(final, ref, shards=2, constant_world=True, result=ok)
    assert ok.ok, ok.to_dict()
    assert {"replicas_agree", "final_weights"} <= set(ok.checked)
    torch.save(_shard_state(2.0 + 1e-12), final / "shard1-11.pt")  # one replica drifted
    torn = inv.CheckResult()
    inv.check_shard_states(final, ref, shards=2, constant_world=False, result=torn)
    assert torn.failed("replicas_agree") and not torn.failed("final_weights"), torn.to_dict()
    (final / "shard0-10.pt").unlink()
    (final / "shard0-11.pt").unlink()
    lost = inv.CheckResult()
    inv.check_shard_states(final, ref, shards=2, constant_world=False, result=lost)
    assert lost.failed("final_weights"), lost.to_dict()


def test_a_live_worker_failing_with_an_error_after_the_last_step_fails_job_completed() -> None:
    steps = _clean_run()  # (last step line at ts 7.0)
    killed = {"event": "failure", "ts": 8.0, "worker_id": "n0.w1", "exit_code": 137,
              "signal": "SIGKILL", "message": "killed by SIGKILL"}  # fmt: skip
    during = {**killed, "ts": 6.0, "exit_code": 1, "signal": None, "message": "reset by peer"}
    ok = inv.CheckResult()
    inv.check_clean_end(steps, [killed, during], ok)
    assert ok.ok, ok.to_dict()
    crashed = {**killed, "exit_code": 1, "signal": None, "message": "AttributeError: close"}
    bad = inv.CheckResult()
    inv.check_clean_end(steps, [killed, crashed], bad)
    assert bad.failed("job_completed") and "AttributeError" in bad.violations[0].detail
