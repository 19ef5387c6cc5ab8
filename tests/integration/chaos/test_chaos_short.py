"""The short chaos run of the suite: several fault kinds against a real 2-node job, fixed
schedule, every invariant checked; and the same run with resharding broken on purpose,
which the exactly-once check must catch."""

from __future__ import annotations

from pathlib import Path

import pytest

from flexrun.testing.chaos import Fault, JobSpec, run_chaos

# Times count from the first trained step. Several kinds: a worker kill, a node loss and a
# node added back, a frozen worker, a corrupted newest checkpoint, a full checkpoint disk.
SHORT_SCHEDULE = [
    Fault(4.0, "kill_worker", 1, 1.0),
    Fault(14.0, "kill_agent", 0, 1.0),
    Fault(28.0, "add_node", 0, 1.0),
    Fault(32.0, "stop_worker", 3, 2.0),
    Fault(38.0, "corrupt_checkpoint", 0, 1.0),
    Fault(39.0, "kill_worker", 0, 1.0),
    Fault(48.0, "disk_full", 0, 1.0),
]


def _spec(root: Path, steps: int, *extra: str) -> JobSpec:
    return JobSpec(
        root=root,
        launcher="restart",
        nodes=2,
        max_nodes=3,
        nproc=1,
        steps=steps,
        step_sleep=0.05,
        ckpt_every=10,
        extra_args=list(extra),
    )


@pytest.mark.timeout(600)
def test_short_chaos_run_keeps_every_invariant(tmp_path: Path) -> None:
    # Enough steps to outlast the schedule (48 s) on a quiet machine: with fast recoveries
    # 500 steps finished before the corrupted checkpoint was due (a skipped fault).
    result = run_chaos(_spec(tmp_path / "chaos", 1000), SHORT_SCHEDULE, timeout_s=420)
    faults = result.stats["faults"]
    assert result.ok, result.to_dict()
    assert set(result.checked) >= {
        "job_completed",
        "exactly_once",
        "final_weights",
        "checkpoints_intact",
        "rounds_never_interleave",
        "no_process_left",
    }
    # The faults really happened (a skipped fault proves nothing).
    for kind in ("kill_agent", "add_node", "stop_worker", "corrupt_checkpoint"):
        assert faults.get(f"{kind}:done", 0) >= 1, faults
    assert faults.get("kill_worker:done", 0) >= 1, faults
    assert 2 in result.stats["worlds"]
    assert result.stats["steps_recomputed"] >= 1


@pytest.mark.timeout(400)
def test_breaking_the_samplers_resharding_fails_the_exactly_once_check(tmp_path: Path) -> None:
    # The workload keeps splitting each step as if the world were 2 ranks; after the node
    # loss the one survivor consumes only half of each global batch.
    result = run_chaos(
        _spec(tmp_path / "broken", 150, "--frozen-shard", "2"),
        [Fault(3.0, "kill_agent", 0, 1.0)],
        timeout_s=300,
    )
    assert result.stats["faults"].get("kill_agent:done") == 1, result.to_dict()
    assert result.failed("exactly_once"), result.to_dict()
    assert not result.failed("no_process_left"), result.to_dict()
