"""The checkpoint memory tier in real ``flexrun run`` jobs (issue 34): a script saving every
step with ``durable_every=20`` loses at most one step to a kill -9 of a worker, of a whole
node (agent and workers), or to a corrupted memory copy, and ends bitwise equal to an
uninterrupted run where the world size stayed the same."""

from __future__ import annotations

import contextlib
import os
import random
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from support import (
    Procs,
    SharedRuns,
    descendants,
    node_args,
    read_events,
    wait_for,
)
from train_support import HERE, read_jsonl

WORKER = HERE / "memtier_worker.py"
STEPS = 40


def _job(procs: Procs, name: str, *script_args: str, worker: Path = WORKER) -> Any:
    return procs.start(
        [
            "run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "3",
            "--run-dir",
            str(procs.tmp / f"run-{name}"),
            str(worker),
            "--ckpt-dir",
            str(procs.tmp / f"ck-{name}"),
            "--steps",
            str(STEPS),
            "--durable-every",
            "20",
            "--step-log",
            str(procs.tmp / f"log-{name}"),
            "--final",
            str(procs.tmp / f"final-{name}.pt"),
            *script_args,
        ],
        name=name,
    )


def _lines(procs: Procs, name: str, rank: int) -> list[dict[str, Any]]:
    return read_jsonl(procs.tmp / f"log-{name}.rank{rank}")


def _last_step(procs: Procs, name: str, rank: int) -> int:
    steps = [r["step"] for r in _lines(procs, name, rank) if "step" in r]
    return steps[-1] if steps else 0


def _assert_bitwise_equal(a: Any, b: Any, path: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), path
        for k in a:
            _assert_bitwise_equal(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_bitwise_equal(x, y, f"{path}/{i}")
    else:
        assert a == b, path


def _reference(
    shared: SharedRuns, key: str = "memtier-ref", job: Any = None, wait_s: float = 150
) -> dict[str, Any]:
    """The final state of the fault-free run of ``job`` (this file's ``_job`` by default),
    made once per suite run under ``key``."""

    def make(procs: Procs) -> Path:
        ref = (job or _job)(procs, "ref")
        assert procs.wait(ref, wait_s) == 0, procs.stderr("ref")
        return procs.tmp / "final-ref.pt"

    return torch.load(shared.get(key, make), weights_only=True)  # type: ignore[no-any-return]


def _loaded(procs: Procs, name: str) -> list[dict[str, Any]]:
    return [e for e in read_events(procs.tmp / f"run-{name}") if e["event"] == "checkpoint_loaded"]


def _durable_steps(path: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in path.glob("step_*"))


@pytest.mark.timeout(400)
def test_kill_9_of_a_worker_resumes_at_the_killed_step_from_memory_bitwise(
    procs: Procs, shared_runs: SharedRuns
) -> None:
    ref = _reference(shared_runs)
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    target, victim = rng.randint(20, 32), rng.randrange(2)
    job = _job(procs, "job", "--step-sleep", "0.1")
    wait_for(lambda: _last_step(procs, "job", victim) >= target, 150, f"step {target}")
    pid = _lines(procs, "job", victim)[0]["pid"]
    os.kill(pid, signal.SIGKILL)
    killed_at = _last_step(procs, "job", victim)
    assert procs.wait(job, 200) == 0, procs.stderr("job")
    resumes = [r for r in _lines(procs, "job", victim) if "resume" in r]
    assert len(resumes) == 2, (resumes, seed)
    # At most one completed step is computed again.
    assert killed_at - 1 <= resumes[1]["resume"] <= killed_at, (resumes, killed_at, seed)
    loaded = _loaded(procs, "job")
    assert loaded[-1]["restored_from"] == "memory", loaded
    final = torch.load(procs.tmp / "final-job.pt", weights_only=True)
    _assert_bitwise_equal(ref, final, f"seed {seed}, kill at {killed_at}")
    mem_dirs = list(Path("/dev/shm").glob(f"flexrun-mem-*-{job.pid}"))
    assert mem_dirs == []  # the agent removed its memory directory at exit
    # The job's ETTR counts the killed attempt's work up to the copy it resumed from (the
    # workers said when each copy could be resumed from), then the last attempt from its
    # first step to the end: as the worker logged it, within the agent's sightings (ticks,
    # hook writes). Neither none of the killed attempt nor all of it.
    lines = _lines(procs, "job", victim)
    starts = [i for i, r in enumerate(lines) if "resume" in r]
    first, second = lines[starts[0] + 1 : starts[1]], lines[starts[1] + 1 :]
    kept = next(r["t"] for r in first if r["step"] == resumes[1]["resume"]) - first[0]["t"]
    (fin,) = [e for e in read_events(procs.tmp / "run-job") if e["event"] == "job_finished"]
    trained = kept + fin["ts"] - second[0]["t"]
    assert abs(fin["productive_s"] - trained) <= 1.0, (fin, kept, trained, seed)


@pytest.mark.timeout(400)
def test_a_corrupted_memory_copy_is_skipped_and_the_one_before_used_bitwise(
    procs: Procs, shared_runs: SharedRuns
) -> None:
    ref = _reference(shared_runs)
    job = _job(procs, "job", "--corrupt-at", "13")
    assert procs.wait(job, 200) == 0, procs.stderr("job")
    events = read_events(procs.tmp / "run-job")
    skipped = [e for e in events if e["event"] == "checkpoint_memory_skipped"]
    assert skipped and {e["step"] for e in skipped} == {13}, skipped
    assert all("checksum mismatch" in e["reason"] for e in skipped), skipped
    resumes = [r["resume"] for r in _lines(procs, "job", 0) if "resume" in r]
    assert resumes == [0, 12], resumes
    assert _loaded(procs, "job")[-1]["restored_from"] == "memory"
    final = torch.load(procs.tmp / "final-job.pt", weights_only=True)
    _assert_bitwise_equal(ref, final)


@pytest.mark.timeout(400)
def test_a_lost_node_costs_at_most_one_step_and_the_survivor_reads_no_storage(
    procs: Procs, store_server: tuple[str, int]
) -> None:
    host, port = store_server
    ck, log = procs.tmp / "ck", procs.tmp / "log"
    agents = {}
    for name in ("a", "b"):
        agents[name] = procs.start(
            [
                *node_args(f"{host}:{port}", name, procs.tmp / f"run-{name}", nproc=1),
                "--max-restarts",
                "3",
                str(WORKER),
                "--ckpt-dir",
                str(ck),
                "--steps",
                str(STEPS),
                "--durable-every",
                "20",
                "--step-log",
                str(log),
                "--step-sleep",
                "0.15",
            ],
            name=name,
        )
    target = random.randint(24, 32)  # past the durable save of step 21 (the first is 1)
    rank0 = procs.tmp / "log.rank0"

    def two_nodes_at_target() -> bool:
        lines = read_jsonl(rank0)
        starts = [i for i, r in enumerate(lines) if "resume" in r]
        if not starts or lines[starts[-1]]["world"] != 2:
            return False  # (a first round may hold one node until the other joins)
        return any(r.get("step", 0) >= target for r in lines[starts[-1] :])

    wait_for(two_nodes_at_target, 200, f"step {target} in a 2-node round")
    # The node of rank 0 (agent and worker) is lost.
    worker0 = [r for r in read_jsonl(rank0) if "resume" in r][-1]["pid"]
    lost = next(n for n, a in agents.items() if worker0 in {p.pid for p in descendants(a.pid)})
    tree = [p.pid for p in descendants(agents[lost].pid)]
    before = len(read_jsonl(rank0))
    os.killpg(agents[lost].pid, signal.SIGKILL)
    for pid in tree:  # the node's workers die with it
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    agents[lost].wait(timeout=30)
    # The step the job had reached (rank 1 may have completed one more than rank 0).
    logged = read_jsonl(rank0) + read_jsonl(procs.tmp / "log.rank1")
    killed_at = max(r.get("step", 0) for r in logged)
    durable_at_kill = _durable_steps(ck)
    survivor = "b" if lost == "a" else "a"
    assert procs.wait(agents[survivor], 250) == 0, procs.stderr(survivor)
    resumes = [r for r in read_jsonl(rank0)[before:] if "resume" in r and r["world"] == 1]
    assert resumes, read_jsonl(rank0)[:3]
    resumed = resumes[0]["resume"]
    assert killed_at - 1 <= resumed <= killed_at, (resumed, killed_at)
    loaded = [
        e for e in read_events(procs.tmp / f"run-{survivor}") if e["event"] == "checkpoint_loaded"
    ]
    assert loaded[-1]["restored_from"] == "memory" and loaded[-1]["step"] == resumed, loaded
    # No storage read: when the survivor resumed at `resumed`, storage held only older
    # steps (the newest durable one is 21), so the state came from its own memory copy.
    assert durable_at_kill and max(durable_at_kill) < resumed, (durable_at_kill, resumed)
