"""Live mode with real processes: survivors never restart, at most the step in flight is lost."""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from support import Procs, descendants, read_events, read_progress, wait_for

LIVE_STEPS = Path(__file__).parent / "scripts" / "live_steps.py"
HB = "heartbeat_interval=0.5,heartbeat_timeout=3,last_call_timeout=0.5,join_timeout=60"


def _run(procs: Procs, name: str, *extra: str, steps: int = 60, nproc: int = 4, spares: int = 1):  # type: ignore[no-untyped-def]
    run = procs.tmp / name
    run.mkdir()
    agent = procs.start(
        [
            "run",
            "--standalone",
            "--nproc-per-node",
            str(nproc),
            "--mode",
            "live",
            "--warm-spares",
            str(spares),
            "--max-restarts",
            "10",
            "--rdzv-conf",
            HB,
            "--run-dir",
            str(run / "run"),
            *extra,
            str(LIVE_STEPS),
            "--steps",
            str(steps),
            "--step-time",
            "0.05",
            "--progress",
            str(run / "p.jsonl"),
            "--out",
            str(run / "w.pt"),
        ],
        name=name,
    )
    return agent, run


def _workers(agent_pid: int, n: int) -> list[int]:
    def find() -> list[int] | None:
        kids = [p.pid for p in descendants(agent_pid) if "live_steps.py" in " ".join(p.cmdline())]
        return kids if len(kids) >= n else None

    return wait_for(find, 90, f"{n} live workers")  # type: ignore[return-value]


def _steps(run: Path) -> list[dict]:
    return [r for r in read_progress(run / "p.jsonl") if "step" in r]


def _wait_step(run: Path, at_least: int) -> None:
    wait_for(
        lambda: max((r["step"] for r in _steps(run)), default=-1) >= at_least,
        90,
        f"step {at_least}",
    )


def _assert_survivors_agree(run: Path) -> list[dict]:
    """Every epoch's members report the same model checksum when they join it."""
    joined = [e for e in read_events(run / "run") if e["event"] == "live_joined"]
    by_epoch: dict[int, set[str]] = {}
    for e in joined:
        by_epoch.setdefault(e["epoch"], set()).add(e["checksum"])
    assert all(len(sums) == 1 for sums in by_epoch.values()), by_epoch
    done = [r for r in read_progress(run / "p.jsonl") if r.get("done")]
    assert len({r["checksum"] for r in done}) == 1, done
    return joined


def _assert_at_most_step_in_flight_redone(run: Path, recoveries: int) -> None:
    per_pid = Counter((r["pid"], r["step"]) for r in _steps(run))
    assert max(per_pid.values()) <= 2
    redone = Counter(pid for (pid, _), n in per_pid.items() if n > 1)
    assert all(n <= recoveries for n in redone.values()), redone


def _reference(procs: Procs, steps: int, nproc: int = 4) -> dict[str, torch.Tensor]:
    agent, run = _run(procs, "reference", steps=steps, nproc=nproc, spares=0)
    assert agent.wait(timeout=240) == 0, procs.stderr("reference")[-2000:]
    return torch.load(run / "w.pt", weights_only=True)


def _spare_ready(run: Path) -> bool:
    return any((run / "run").rglob("spare-*.ready"))


@pytest.mark.timeout(400)
def test_kill_9_of_a_worker_keeps_survivors_and_a_warm_spare_keeps_the_run_bitwise_identical(
    procs: Procs,
) -> None:
    steps = 60
    reference = _reference(procs, steps)
    agent, run = _run(procs, "killed", steps=steps)
    pids = _workers(agent.pid, 4)
    _wait_step(run, 5)
    wait_for(lambda: _spare_ready(run), 90, "a warm spare to be ready")
    victim = pids[1]
    os.kill(victim, signal.SIGKILL)
    assert agent.wait(timeout=240) == 0, procs.stderr("killed")[-3000:]

    survivors = set(pids) - {victim}
    late = [r for r in _steps(run) if r["step"] >= steps - 5]
    assert survivors <= {r["pid"] for r in late}, "a survivor was restarted"
    assert {r["world"] for r in late} == {4}
    joined = _assert_survivors_agree(run)
    assert any(e["epoch"] >= 2 and e["source"] is not None for e in joined), (
        "the spare got no state"
    )
    _assert_at_most_step_in_flight_redone(run, recoveries=1)
    final = torch.load(run / "w.pt", weights_only=True)
    assert all(torch.equal(final[k], reference[k]) for k in reference), "not bitwise identical"


@pytest.mark.timeout(400)
def test_without_a_spare_survivors_shrink_at_once_and_the_replacement_joins_at_a_step_boundary(
    procs: Procs,
) -> None:
    steps = 300  # long enough (15 s after the kill) for a cold replacement to join, even on a busy machine
    reference = _reference(procs, steps)
    agent, run = _run(procs, "shrink", steps=steps, spares=0)
    pids = _workers(agent.pid, 4)
    _wait_step(run, 5)
    os.kill(pids[2], signal.SIGKILL)
    t_kill = time.time()
    assert agent.wait(timeout=240) == 0, procs.stderr("shrink")[-3000:]
    rows = _steps(run)
    assert any(r["world"] == 3 and r["ts"] > t_kill for r in rows), "no training at world size 3"
    assert {r["world"] for r in rows if r["step"] >= steps - 3} == {4}, (
        "the replacement never joined"
    )
    assert set(pids) - {pids[2]} <= {r["pid"] for r in rows if r["step"] >= steps - 3}
    _assert_survivors_agree(run)
    _assert_at_most_step_in_flight_redone(run, recoveries=1)
    final = torch.load(run / "w.pt", weights_only=True)
    for k, ref in reference.items():
        assert torch.allclose(final[k], ref, rtol=1e-5, atol=1e-7), (
            k,
            (final[k] - ref).abs().max(),
        )
    _assert_every_sample_once_per_data_epoch(rows, global_batch=24, dataset=240)


def _assert_every_sample_once_per_data_epoch(
    rows: list[dict], *, global_batch: int, dataset: int
) -> None:
    """The committed execution of each step is the one of its latest epoch; across a data
    epoch those executions consumed every sample exactly once, whatever the world sizes."""
    by_step: dict[int, list[dict]] = {}
    for r in rows:
        by_step.setdefault(r["step"], []).append(r)
    per_data_epoch: dict[int, list[int]] = {}
    for step, rs in sorted(by_step.items()):
        epoch = max(r["epoch"] for r in rs)
        ids = [i for r in rs if r["epoch"] == epoch for i in r["ids"]]
        assert len(ids) == global_batch, (step, len(ids))
        per_data_epoch.setdefault(step * global_batch // dataset, []).extend(ids)
    complete = [
        ids for e, ids in per_data_epoch.items() if (e + 1) * dataset <= len(by_step) * global_batch
    ]
    assert complete
    for ids in complete:
        assert sorted(ids) == list(range(dataset))


@pytest.mark.timeout(300)
def test_a_stopped_worker_is_excluded_within_the_heartbeat_timeout(procs: Procs) -> None:
    agent, run = _run(procs, "stopped", steps=100000, spares=0)
    pids = _workers(agent.pid, 4)
    _wait_step(run, 5)
    os.kill(pids[3], signal.SIGSTOP)
    t_stop = time.time()
    wait_for(
        lambda: any(r["world"] == 3 and r["ts"] > t_stop for r in _steps(run)),
        30,
        "the others to continue without the stopped worker",
    )
    hang = [e for e in read_events(run / "run") if e["event"] == "hang_detected"]
    assert hang and hang[0]["ts"] - t_stop < 3 + 2, hang
    assert all(p in {r["pid"] for r in _steps(run) if r["ts"] > t_stop} for p in pids[:3])
    _assert_survivors_agree_so_far(run)
    agent.send_signal(signal.SIGTERM)
    assert agent.wait(timeout=60) == 143


def _assert_survivors_agree_so_far(run: Path) -> None:
    events_dir = run / "run" if (run / "run").exists() else run
    joined = [e for e in read_events(events_dir) if e["event"] == "live_joined"]
    by_epoch: dict[int, set[str]] = {}
    for e in joined:
        by_epoch.setdefault(e["epoch"], set()).add(e["checksum"])
    assert all(len(s) == 1 for s in by_epoch.values()), by_epoch


@pytest.mark.timeout(300)
def test_two_nodes_live_kill_9_of_one_agent_keeps_the_others_pids_and_a_new_agent_joins(
    procs: Procs, store_server: tuple[str, int]
) -> None:
    host, port = store_server
    progress = procs.tmp / "p.jsonl"

    def agent(name: str):  # type: ignore[no-untyped-def]
        return procs.start(
            [
                "run",
                "--nnodes",
                "1:2",
                "--nproc-per-node",
                "2",
                "--mode",
                "live",
                "--warm-spares",
                "0",
                "--rdzv-endpoint",
                f"{host}:{port}",
                "--rdzv-id",
                "livejob",
                "--rdzv-conf",
                HB,
                "--max-restarts",
                "5",
                "--node-id",
                name,
                "--run-dir",
                str(procs.tmp / f"run-{name}"),
                str(LIVE_STEPS),
                "--steps",
                "100000",
                "--step-time",
                "0.05",
                "--progress",
                str(progress),
            ],
            name=name,
        )

    a = agent("a")
    wait_for(lambda: read_progress(progress), 90, "node a to train")
    b = agent("b")
    wait_for(
        lambda: any(r.get("world") == 4 for r in read_progress(progress)),
        90,
        "the job at 2 nodes (world 4)",
    )
    b_pids = _workers(b.pid, 2)
    os.killpg(a.pid, signal.SIGKILL)
    a.wait(timeout=10)
    t_kill = time.time()
    wait_for(
        lambda: any(r.get("world") == 2 and r["ts"] > t_kill for r in read_progress(progress)),
        60,
        "node b alone at world 2",
    )
    after = [r for r in read_progress(progress) if r.get("ts", 0) > t_kill + 0.5 and "step" in r]
    assert {r["pid"] for r in after if r["world"] == 2} == set(b_pids), (
        "node b's workers were restarted"
    )
    t_join = time.time()
    agent("c")
    wait_for(
        lambda: any(r.get("world") == 4 and r["ts"] > t_join for r in read_progress(progress)),
        90,
        "a new node to join at a step boundary",
    )
    grown = [r for r in read_progress(progress) if r.get("ts", 0) > t_join and r.get("world") == 4]
    assert set(b_pids) <= {r["pid"] for r in grown}
    assert b.poll() is None
    _assert_survivors_agree_so_far(procs.tmp / "run-b")
