"""The short chaos run of an HSDP live job: 2 agents, each one replica group of 2 FSDP2
shards (``--live-shards 2``), a fixed schedule of the faults a sharded live job must
survive, every invariant checked (each sample once per committed step, the final shards'
replicas bitwise equal to each other and to a fault-free reference's within tolerance)."""

from __future__ import annotations

from pathlib import Path

import pytest

from flexrun.testing import invariants as inv
from flexrun.testing.chaos import Fault, JobSpec, run_chaos

# Times count from the first trained step: a shard worker killed, one frozen, a node (one
# whole replica group) lost and one added back, a slowed shard worker, a corrupted checkpoint.
HSDP_SCHEDULE = [
    Fault(3.0, "kill_worker", 3, 1.0),
    Fault(9.0, "stop_worker", 0, 1.5),
    Fault(15.0, "kill_agent", 1, 1.0),
    Fault(21.0, "add_node", 0, 1.0),
    Fault(28.0, "slow_rank", 1, 1.0),
    Fault(31.0, "corrupt_checkpoint", 0, 1.0),
]


def _spec(root: Path, steps: int) -> JobSpec:
    return JobSpec(
        root=root,
        launcher="live",
        nodes=2,
        max_nodes=2,
        nproc=2,
        shards=2,
        steps=steps,
        step_sleep=0.05,
        ckpt_every=10,
    )


@pytest.mark.timeout(600)
def test_short_hsdp_chaos_run_keeps_every_invariant(tmp_path: Path) -> None:
    spec = _spec(tmp_path / "hsdp", 600)
    result = run_chaos(spec, HSDP_SCHEDULE, timeout_s=420)
    assert result.ok, result.to_dict()
    assert {"exactly_once", "replicas_agree", "final_weights", "checkpoints_intact"} <= set(
        result.checked
    )
    faults = result.stats["faults"]
    for kind in ("kill_worker", "stop_worker", "kill_agent", "add_node", "slow_rank"):
        assert faults.get(f"{kind}:done", 0) == 1, faults
    # One group trained alone (2 ranks) after the node loss, two groups (4) otherwise.
    assert {2, 4} <= set(result.stats["worlds"]), result.stats
    assert all(n >= 1 for n in result.stats["final_replicas"].values()), result.stats


@pytest.mark.timeout(600)
def test_a_group_whose_first_durable_save_follows_a_store_restart_keeps_training(
    tmp_path: Path,
) -> None:
    """The store restarts, then the node of the first replica group (the one that saves)
    is lost: the other group becomes the saver, and its first save comes after the
    restart. Found by the 150 s chaos runs: that save formed its gloo group over the
    group's store client, which does not reconnect; it hung for minutes, then the group
    died (DistNetworkError) and the job fell back to its durable checkpoint."""
    spec = _spec(tmp_path / "hsdp-store", 400)
    result = run_chaos(
        spec,
        [Fault(3.0, "restart_store", 0, 1.0), Fault(12.0, "kill_agent", 0, 1.0)],
        timeout_s=420,
    )
    faults = result.stats["faults"]
    assert faults.get("restart_store:done") == 1 and faults.get("kill_agent:done") == 1, faults
    events = inv.read_events(spec.root / "runs")
    failed = [e for e in events if e["event"] in ("failure", "live_fallback")]
    assert not failed, failed
    assert result.ok, result.to_dict()
    assert result.stats["latest"] == 400, result.stats
