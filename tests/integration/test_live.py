"""Live mode with real processes: survivors never restart, at most the step in flight is lost."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from live_support import (
    assert_at_most_step_in_flight_redone,
    assert_every_sample_once_per_data_epoch,
    assert_survivors_agree,
    assert_survivors_agree_so_far,
    kill_a_worker_beside_a_warm_spare,
    live_workers,
    reference_weights,
    start_live,
    start_live_node,
    step_rows,
    wait_step,
)
from support import Procs, SharedRuns, read_events, read_progress, wait_for


@pytest.mark.timeout(400)
def test_kill_9_of_a_worker_keeps_survivors_and_a_warm_spare_keeps_the_run_bitwise_identical(
    procs: Procs,
    shared_runs: SharedRuns,
) -> None:
    steps = 300  # the spare starts once the workers are up: leave it time to get ready
    reference = reference_weights(shared_runs, steps)
    agent, run = start_live(procs, "killed", steps=steps)
    kill_a_worker_beside_a_warm_spare(procs, agent, run, steps, reference)
    # The survivors' pause (and any step slowed after it) is lost time, off the job's ETTR.
    done = [e for e in read_events(run / "run") if e["event"] == "job_finished"]
    assert done and done[-1]["lost_s"] > 0 and done[-1]["ettr"] < 1, done
    assert done[-1]["ettr"] < done[-1]["failure_ettr"] < 1, done  # (the lost time is failure's)


@pytest.mark.timeout(400)
def test_without_a_spare_survivors_shrink_at_once_and_the_replacement_joins_at_a_step_boundary(
    procs: Procs,
    shared_runs: SharedRuns,
) -> None:
    steps = 300  # long enough (15 s after the kill) for a cold replacement to join, even on a busy machine
    reference = reference_weights(shared_runs, steps)
    agent, run = start_live(procs, "shrink", steps=steps, spares=0)
    pids = live_workers(run / "run", 4)
    wait_step(run, 5)
    os.kill(pids[2], signal.SIGKILL)
    t_kill = time.time()
    assert agent.wait(timeout=240) == 0, procs.stderr("shrink")[-3000:]
    rows = step_rows(run)
    assert any(r["world"] == 3 and r["ts"] > t_kill for r in rows), "no training at world size 3"
    assert {r["world"] for r in rows if r["step"] >= steps - 3} == {4}, (
        "the replacement never joined"
    )
    assert set(pids) - {pids[2]} <= {r["pid"] for r in rows if r["step"] >= steps - 3}
    assert_survivors_agree(run)
    assert_at_most_step_in_flight_redone(run, recoveries=1)
    final = torch.load(run / "w.pt", weights_only=True)
    for k, ref in reference.items():
        # 1e-5 relative for each tensor as a whole: an element near zero may differ by a
        # few 1e-7 after hundreds of steps summed in another order (world 3 vs 4).
        rel = float((final[k] - ref).norm() / ref.norm())
        assert rel <= 1e-5, (k, rel, (final[k] - ref).abs().max())
    assert_every_sample_once_per_data_epoch(rows, global_batch=24, dataset=240)


@pytest.mark.timeout(300)
def test_a_stopped_worker_is_excluded_within_the_heartbeat_timeout(procs: Procs) -> None:
    agent, run = start_live(procs, "stopped", steps=100000, spares=0)
    pids = live_workers(run / "run", 4)
    wait_step(run, 5)
    os.kill(pids[3], signal.SIGSTOP)
    t_stop = time.time()
    wait_for(  # (each survivor logs its own steps: wait for all three, not the first line)
        lambda: (
            set(pids[:3])
            <= {r["pid"] for r in step_rows(run) if r["world"] == 3 and r["ts"] > t_stop}
        ),
        30,
        "the others to continue without the stopped worker",
    )
    hang = [e for e in read_events(run / "run") if e["event"] == "hang_detected"]
    assert hang and hang[0]["ts"] - t_stop < 3 + 2, hang
    assert_survivors_agree_so_far(run)
    agent.send_signal(signal.SIGTERM)
    assert agent.wait(timeout=60) == 143


@pytest.mark.timeout(300)
def test_two_nodes_live_kill_9_of_one_agent_keeps_the_others_pids_and_a_new_agent_joins(
    procs: Procs, store_server: tuple[str, int]
) -> None:
    host, port = store_server
    progress = procs.tmp / "p.jsonl"

    def agent(name: str):  # type: ignore[no-untyped-def]
        return start_live_node(
            procs,
            f"{host}:{port}",
            name,
            progress,
            "--warm-spares",
            "0",
            "--max-restarts",
            "5",
            nproc=2,
        )

    a = agent("a")
    wait_for(lambda: read_progress(progress), 90, "node a to train")
    b = agent("b")
    wait_for(
        lambda: any(r.get("world") == 4 for r in read_progress(progress)),
        90,
        "the job at 2 nodes (world 4)",
    )
    b_pids = live_workers(procs.tmp / "run-b", 2)

    def pids_at(world: int, since: float) -> set[int]:
        """The workers that logged a step at ``world`` after ``since`` (each logs its own:
        wait for all of them, not the first line, which one worker writes alone)."""
        rows = read_progress(progress)
        return {
            r["pid"]
            for r in rows
            if "step" in r and r.get("world") == world and r.get("ts", 0) > since
        }

    os.killpg(a.pid, signal.SIGKILL)
    a.wait(timeout=10)
    t_kill = time.time()
    wait_for(lambda: len(pids_at(2, t_kill + 0.5)) >= 2, 60, "node b alone at world 2")
    assert pids_at(2, t_kill + 0.5) == set(b_pids), "node b's workers were restarted"
    t_join = time.time()
    agent("c")
    wait_for(lambda: len(pids_at(4, t_join)) >= 4, 90, "a new node to join at a step boundary")
    assert set(b_pids) <= pids_at(4, t_join), "node b's workers were restarted"
    assert b.poll() is None
    assert_survivors_agree_so_far(procs.tmp / "run-b")
