"""Live mode falls back to restart mode when live recovery cannot succeed (issue 5, item 5):
every worker dies at once, or the members' states disagree. Real processes and signals; the
disagreement is injected by the workload script itself (``live_steps.py --corrupt-at``)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from live_support import (
    assert_every_sample_once_per_data_epoch,
    assert_survivors_agree,
    live_workers,
    reference_weights,
    spare_ready,
    start_live,
    step_rows,
)
from support import Procs, SharedRuns, read_events, wait_for

STEPS = 100
ALL_STEPS = (
    300  # long enough that a warm spare is ready well before the end, even on a busy machine
)
CKPT_EVERY = 5


def _durable_steps(run: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in (run / "ckpt").glob("step_*") if p.name[5:].isdigit())


def _fallbacks(run: Path) -> list[dict]:
    return [e for e in read_events(run / "run") if e["event"] == "live_fallback"]


@pytest.mark.timeout(500)
def test_kill_9_of_every_worker_restarts_all_from_the_latest_checkpoint_bitwise(
    procs: Procs,
    shared_runs: SharedRuns,
) -> None:
    reference = reference_weights(shared_runs, ALL_STEPS)
    ckpt = procs.tmp / "all" / "ckpt"
    agent, run = start_live(
        procs,
        "all",
        steps=ALL_STEPS,
        script_args=("--ckpt-dir", str(ckpt), "--ckpt-every", str(CKPT_EVERY)),
    )
    pids = live_workers(run / "run", 4)
    wait_for(lambda: len(_durable_steps(run)) >= 2, 120, "two durable checkpoints")
    wait_for(lambda: spare_ready(run), 90, "a warm spare to be ready")
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    t_kill = time.time()
    assert max(r["step"] for r in step_rows(run)) < ALL_STEPS - 20, "killed too late to test"
    durable_at_kill = _durable_steps(run)[-1]
    assert agent.wait(timeout=300) == 0, procs.stderr("all")[-3000:]

    events = read_events(run / "run")
    restarts = [e for e in events if e["event"] == "restart" and e.get("reason") == "live_fallback"]
    assert restarts and "every worker" in restarts[0]["detail"], restarts
    fb = _fallbacks(run)
    assert len(fb) == 1, fb
    assert "every worker" in fb[0]["reason"] and fb[0]["source"] == "durable checkpoint", fb
    assert fb[0]["step"] == durable_at_kill, (fb, durable_at_kill)

    after = [r for r in step_rows(run) if r["ts"] > t_kill]
    assert not {r["pid"] for r in after} & set(pids), "a killed worker trained again"
    assert min(r["step"] for r in after) == fb[0]["step"], "did not resume at the checkpoint"
    assert {r["world"] for r in after} == {4}, "the restart did not restore the full world"
    assert_survivors_agree(run)
    assert_every_sample_once_per_data_epoch(step_rows(run), global_batch=24, dataset=240)
    final = torch.load(run / "w.pt", weights_only=True)
    assert all(torch.equal(final[k], reference[k]) for k in reference), "not bitwise identical"


@pytest.mark.timeout(500)
def test_members_that_disagree_on_the_model_fall_back_to_the_checkpoint_bitwise(
    procs: Procs,
    shared_runs: SharedRuns,
) -> None:
    reference = reference_weights(shared_runs, STEPS)
    corrupt_at = 17  # after the checkpoint of step 15, before the one of step 20
    ckpt = procs.tmp / "bad" / "ckpt"
    agent, run = start_live(
        procs,
        "bad",
        steps=STEPS,
        script_args=(
            "--ckpt-dir",
            str(ckpt),
            "--ckpt-every",
            str(CKPT_EVERY),
            "--corrupt-at",
            str(corrupt_at),
            "--corrupt-rank",
            "1",
            "--die-rank",
            "3",
            "--once",
            str(procs.tmp / "bad" / "fault"),
        ),
    )
    pids = live_workers(run / "run", 4)
    wait_for(lambda: spare_ready(run), 90, "a warm spare to be ready")  # keeps the world at 4
    (procs.tmp / "bad" / "fault.go").touch()
    assert agent.wait(timeout=300) == 0, procs.stderr("bad")[-3000:]
    assert (procs.tmp / "bad" / "fault").exists(), "the fault was never injected"

    fb = _fallbacks(run)
    assert len(fb) == 1, fb
    assert "disagree on the model checksum" in fb[0]["reason"], fb
    assert fb[0]["source"] == "durable checkpoint" and fb[0]["step"] == 15, fb
    rows = step_rows(run)
    killed = {r["pid"] for r in rows if r["rank"] == 3 and r["step"] < corrupt_at}
    survivors = set(pids) - killed
    late = [r for r in rows if r["step"] >= STEPS - 5]
    assert survivors <= {r["pid"] for r in late}, "a survivor was restarted"
    redone = [r for r in rows if r["epoch"] > 1 and r["step"] == 15]
    assert len(redone) == 4, "the members did not resume at the checkpoint (step 15)"
    assert_survivors_agree(run)
    assert_every_sample_once_per_data_epoch(rows, global_batch=24, dataset=240)
    final = torch.load(run / "w.pt", weights_only=True)
    assert all(torch.equal(final[k], reference[k]) for k in reference), "not bitwise identical"
