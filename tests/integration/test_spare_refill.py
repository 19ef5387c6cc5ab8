"""Restart mode's warm pool is refilled as soon as a round's workers came from spares.

The long chaos run (bench/results/chaos.txt) spent ~1.8 s of many restarts waiting for a
spare to boot: a round whose workers were warm spares did not start the next spare until
SPARE_DELAY_S after its start, and rounds killed by the next fault lived less than that.
"""

from __future__ import annotations

import os
import signal

import psutil
import pytest
from support import (
    DDP_STEPS,
    Procs,
    alive_pids,
    descendants,
    endless,
    read_events,
    read_progress,
    wait_for,
)


def _started(run_dir: object, rnd: int) -> int | None:
    for e in read_events(run_dir):  # type: ignore[arg-type]
        if e["event"] == "worker_started" and e["round"] == rnd:
            return int(e["pid"])
    return None


def _trained(progress: object, pid: int) -> bool:
    return any(r["pid"] == pid for r in read_progress(progress))  # type: ignore[arg-type]


@pytest.mark.timeout(90)
def test_a_worker_killed_soon_after_a_warm_restart_finds_its_replacement_spare_started_before(
    procs: Procs,
) -> None:
    run_dir = procs.tmp / "run"
    progress = procs.tmp / "progress.jsonl"
    agent = procs.start(
        [
            "run",
            "--standalone",
            "--nproc-per-node",
            "1",
            "--warm-spares",
            "1",
            "--max-restarts",
            "5",
            "--monitor-interval",
            "0.1",
            "--run-dir",
            str(run_dir),
            *endless(DDP_STEPS, progress),
        ],
        name="agent",
    )
    spares = run_dir / "logs" / "spares"
    pids = []
    # Round 1 starts cold or forked (with stdin /dev/null); once a spare is ready, kill the
    # worker: round 2 is warm.
    first = wait_for(lambda: _started(run_dir, 1), 60, "round 1's worker")
    wait_for(lambda: any(spares.glob("*.ready")), 60, "a ready spare")
    pids.append(first)
    os.kill(first, signal.SIGKILL)  # type: ignore[arg-type]
    second = wait_for(lambda: _started(run_dir, 2), 30, "round 2's worker")
    pids.append(second)
    # Kill round 2's worker at its first step: well inside the old 3 s delay.
    wait_for(lambda: _trained(progress, second), 30, "round 2's first step")  # type: ignore[arg-type]
    before = {
        p.pid for p in descendants(agent.pid) if "flexrun.spares.spare" in " ".join(p.cmdline())
    }
    os.kill(second, signal.SIGKILL)  # type: ignore[arg-type]
    third = wait_for(lambda: _started(run_dir, 3), 30, "round 3's worker")
    pids.append(third)
    wait_for(lambda: _trained(progress, third), 30, "round 3's first step")  # type: ignore[arg-type]
    cmd = " ".join(psutil.Process(third).cmdline())  # type: ignore[arg-type]
    assert f"-u {DDP_STEPS}" in cmd, f"the spare did not take the worker's command line: {cmd}"
    assert third in before, (
        "round 3's spare was started only after round 2's worker died: the pool was not "
        f"refilled when round 2 started from a spare (spares before the kill: {sorted(before)})"
    )
    agent.send_signal(signal.SIGTERM)
    assert agent.wait(timeout=30) == 143, procs.stderr("agent")[-3000:]
    assert alive_pids(pids) == []  # type: ignore[arg-type]


def _round_pids(run_dir: object, rnd: int) -> list[int]:
    return [
        int(e["pid"])
        for e in read_events(run_dir)  # type: ignore[arg-type]
        if e["event"] == "worker_started" and e["round"] == rnd
    ]


@pytest.mark.timeout(120)
def test_a_second_failure_right_after_a_warm_restart_is_served_by_spares_forked_before_it(
    procs: Procs,
) -> None:
    """Issue 20 (a burst of failures), default flags: a restart takes every local worker's
    spare; the pool refills by fork at once, so a kill at the restarted round's first step
    finds ready spares for all of the next round's workers."""
    run_dir = procs.tmp / "run"
    progress = procs.tmp / "progress.jsonl"
    agent = procs.start(
        [
            "run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "5",
            "--monitor-interval",
            "0.1",
            "--run-dir",
            str(run_dir),
            *endless(DDP_STEPS, progress),
        ],
        name="agent",
    )
    spares = run_dir / "logs" / "spares"
    first = wait_for(lambda: len(_round_pids(run_dir, 1)) == 2 or None, 60, "round 1's workers")
    wait_for(lambda: len(list(spares.glob("spare-*.ready"))) >= 2, 60, "2 ready spares")
    os.kill(_round_pids(run_dir, 1)[0], signal.SIGKILL)
    wait_for(lambda: len(_round_pids(run_dir, 2)) == 2 or None, 30, "round 2's workers")
    second = _round_pids(run_dir, 2)
    wait_for(lambda: _trained(progress, second[1]), 30, "round 2's first step")  # type: ignore[arg-type]
    forked = {p.pid for p in descendants(agent.pid) if "--fork-server" in " ".join(p.cmdline())}
    os.kill(second[1], signal.SIGKILL)
    wait_for(lambda: len(_round_pids(run_dir, 3)) == 2 or None, 30, "round 3's workers")
    third = _round_pids(run_dir, 3)
    wait_for(lambda: all(_trained(progress, p) for p in third), 30, "round 3's first steps")  # type: ignore[arg-type]
    assert set(third) <= forked, (
        f"round 3's workers {third} were not spares forked before the second kill "
        f"({sorted(forked)})"
    )
    agent.send_signal(signal.SIGTERM)
    assert agent.wait(timeout=30) == 143, procs.stderr("agent")[-3000:]
    assert first and alive_pids([*second, *third, *forked]) == []
