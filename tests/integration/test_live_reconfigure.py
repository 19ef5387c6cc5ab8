"""Live mode re-forming its groups in place (torch >= 2.14): a kill -9 costs the same
guarantees as on the fresh-group path, and the events say which path ran."""

from __future__ import annotations

import pytest
from live_support import (
    kill_a_worker_beside_a_warm_spare,
    reference_weights,
    start_live,
)
from support import Procs, SharedRuns, read_events

from flexrun.train.live_reconf import unsupported_reason

pytestmark = pytest.mark.skipif(
    unsupported_reason(True) is not None,
    reason=f"in-place reconfigure needs torch >= 2.14: {unsupported_reason(True)}",
)


@pytest.mark.timeout(400)
def test_kill_9_with_groups_reformed_in_place_keeps_survivors_and_equals_a_fresh_group_run(
    procs: Procs, shared_runs: SharedRuns, monkeypatch: pytest.MonkeyPatch
) -> None:
    steps = 300
    monkeypatch.setenv("FLEXRUN_LIVE_RECONFIGURE", "0")  # (the reference: fresh groups)
    reference = reference_weights(shared_runs, steps)
    monkeypatch.delenv("FLEXRUN_LIVE_RECONFIGURE")
    agent, run = start_live(procs, "killed", steps=steps)
    kill_a_worker_beside_a_warm_spare(procs, agent, run, steps, reference)

    events = read_events(run / "run")
    chosen = {e["group_path"] for e in events if e["event"] == "live_group_path"}
    assert chosen == {"reconfigure"}, chosen
    assert not [e for e in events if e["event"] == "live_group_fallback"]
    after_kill = [e for e in events if e["event"] == "live_joined" and e["epoch"] >= 2]
    assert after_kill and {e["group_path"] for e in after_kill} == {"reconfigure"}, after_kill
    assert {e["rank"] for e in after_kill} == {0, 1, 2, 3}
