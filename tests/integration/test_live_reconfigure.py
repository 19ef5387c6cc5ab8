"""Live mode re-forming its groups in place (torch >= 2.14): a kill -9 costs the same
guarantees as on the fresh-group path, and the events say which path ran."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from live_support import (
    assert_at_most_step_in_flight_redone,
    assert_survivors_agree,
    live_workers,
    reference_weights,
    spare_ready,
    start_live,
    step_rows,
    wait_step,
)
from support import Procs, read_events, wait_for

from flexrun.train.live_reconf import unsupported_reason

pytestmark = pytest.mark.skipif(
    unsupported_reason(True) is not None,
    reason=f"in-place reconfigure needs torch >= 2.14: {unsupported_reason(True)}",
)


@pytest.mark.timeout(400)
def test_kill_9_with_groups_reformed_in_place_keeps_survivors_and_equals_a_fresh_group_run(
    procs: Procs, monkeypatch: pytest.MonkeyPatch
) -> None:
    steps = 300
    monkeypatch.setenv("FLEXRUN_LIVE_RECONFIGURE", "0")  # (the reference: fresh groups)
    reference = reference_weights(procs, steps)
    monkeypatch.delenv("FLEXRUN_LIVE_RECONFIGURE")
    agent, run = start_live(procs, "killed", steps=steps)
    pids = live_workers(run / "run", 4)
    wait_step(run, 5)
    wait_for(lambda: spare_ready(run), 90, "a warm spare to be ready")
    victim = pids[1]
    os.kill(victim, signal.SIGKILL)
    assert max(r["step"] for r in step_rows(run)) < steps - 20, "killed too late to test"
    assert agent.wait(timeout=240) == 0, procs.stderr("killed")[-3000:]

    survivors = set(pids) - {victim}
    late = [r for r in step_rows(run) if r["step"] >= steps - 5]
    assert survivors <= {r["pid"] for r in late}, "a survivor was restarted"
    assert {r["world"] for r in late} == {4}
    joined = assert_survivors_agree(run)
    assert any(e["epoch"] >= 2 and e["source"] is not None for e in joined), "spare got no state"
    assert_at_most_step_in_flight_redone(run, recoveries=1)
    final = torch.load(run / "w.pt", weights_only=True)
    assert all(torch.equal(final[k], reference[k]) for k in reference), "not bitwise identical"

    events = read_events(run / "run")
    chosen = {e["group_path"] for e in events if e["event"] == "live_group_path"}
    assert chosen == {"reconfigure"}, chosen
    assert not [e for e in events if e["event"] == "live_group_fallback"]
    after_kill = [e for e in events if e["event"] == "live_joined" and e["epoch"] >= 2]
    assert after_kill and {e["group_path"] for e in after_kill} == {"reconfigure"}, after_kill
    assert {e["rank"] for e in after_kill} == {0, 1, 2, 3}
