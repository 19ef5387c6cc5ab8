"""Helpers for live-mode integration tests (tests/integration/test_live*.py)."""

from __future__ import annotations

import os
import signal
from collections import Counter
from pathlib import Path

import torch
from support import Procs, SharedRuns, endless, read_events, read_progress, wait_for

LIVE_STEPS = Path(__file__).parent / "scripts" / "live_steps.py"
HB = "heartbeat_interval=0.5,heartbeat_timeout=3,last_call_timeout=0.5,join_timeout=60"


def start_live(  # type: ignore[no-untyped-def]
    procs: Procs,
    name: str,
    *extra: str,
    steps: int = 60,
    nproc: int = 4,
    spares: int = 1,
    script_args: tuple[str, ...] = (),
):
    """Start a one-node live agent on live_steps.py; (agent, its test directory)."""
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
            *script_args,
        ],
        name=name,
    )
    return agent, run


def start_live_node(  # type: ignore[no-untyped-def]
    procs: Procs,
    endpoint: str,
    name: str,
    progress: Path,
    *extra: str,
    nproc: int,
):
    """One live agent as node ``name`` of job ``livejob`` on the store at ``endpoint``,
    training live_steps.py until stopped; its run directory is ``procs.tmp/run-<name>``."""
    return procs.start(
        [
            "run",
            "--nnodes",
            "1:2",
            "--nproc-per-node",
            str(nproc),
            "--mode",
            "live",
            "--rdzv-endpoint",
            endpoint,
            "--rdzv-id",
            "livejob",
            "--rdzv-conf",
            HB,
            "--node-id",
            name,
            "--run-dir",
            str(procs.tmp / f"run-{name}"),
            *extra,
            *endless(LIVE_STEPS, progress),
        ],
        name=name,
    )


def live_workers(run_dir: Path, n: int) -> list[int]:
    """PIDs of the first ``n`` workers the agent started (from warm spares or fresh), in
    local-rank order. A spare-based worker's command line names no script: use the events."""

    def find() -> list[int] | None:
        pids = [e["pid"] for e in read_events(run_dir) if e["event"] == "worker_started"]
        return pids[:n] if len(pids) >= n else None

    return wait_for(find, 90, f"{n} live workers")  # type: ignore[return-value]


def step_rows(run: Path) -> list[dict]:
    return [r for r in read_progress(run / "p.jsonl") if "step" in r]


def wait_step(run: Path, at_least: int) -> None:
    wait_for(
        lambda: max((r["step"] for r in step_rows(run)), default=-1) >= at_least,
        90,
        f"step {at_least}",
    )


def assert_survivors_agree(run: Path) -> list[dict]:
    """Every epoch's members report the same model checksum when they join it."""
    joined = [e for e in read_events(run / "run") if e["event"] == "live_joined"]
    by_epoch: dict[int, set[str]] = {}
    for e in joined:
        by_epoch.setdefault(e["epoch"], set()).add(e["checksum"])
    assert all(len(sums) == 1 for sums in by_epoch.values()), by_epoch
    done = [r for r in read_progress(run / "p.jsonl") if r.get("done")]
    assert len({r["checksum"] for r in done}) == 1, done
    return joined


def assert_at_most_step_in_flight_redone(run: Path, recoveries: int) -> None:
    per_pid = Counter((r["pid"], r["step"]) for r in step_rows(run))
    assert max(per_pid.values()) <= 2
    redone = Counter(pid for (pid, _), n in per_pid.items() if n > 1)
    assert all(n <= recoveries for n in redone.values()), redone


def reference_weights(shared: SharedRuns, steps: int, nproc: int = 4) -> dict[str, torch.Tensor]:
    """The final weights of a fault-free live run of ``steps`` (made once per session)."""

    def make(procs: Procs) -> Path:
        agent, run = start_live(procs, "reference", steps=steps, nproc=nproc, spares=0)
        assert agent.wait(timeout=240) == 0, procs.stderr("reference")[-2000:]
        return run / "w.pt"

    group_path = os.environ.get("FLEXRUN_LIVE_RECONFIGURE", "default")
    path = shared.get(f"live-{steps}-{nproc}-{group_path}", make)
    return torch.load(path, weights_only=True)


def spare_ready(run: Path) -> bool:
    return any((run / "run").rglob("spare-*.ready"))


def assert_every_sample_once_per_data_epoch(
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


def assert_survivors_agree_so_far(run: Path) -> None:
    events_dir = run / "run" if (run / "run").exists() else run
    joined = [e for e in read_events(events_dir) if e["event"] == "live_joined"]
    by_epoch: dict[int, set[str]] = {}
    for e in joined:
        by_epoch.setdefault(e["epoch"], set()).add(e["checksum"])
    assert all(len(s) == 1 for s in by_epoch.values()), by_epoch


def kill_a_worker_beside_a_warm_spare(  # type: ignore[no-untyped-def]
    procs: Procs, agent, run: Path, steps: int, reference: dict[str, torch.Tensor]
) -> None:
    """The one-kill live scenario on a job from :func:`start_live` (named ``killed``): once
    it trains and a warm spare is ready, kill -9 of rank 1; the job ends 0 with the
    survivors' PIDs still stepping at the end in a world of 4, the spare given state by a
    peer, at most the step in flight redone, and final weights bitwise ``reference``."""
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
