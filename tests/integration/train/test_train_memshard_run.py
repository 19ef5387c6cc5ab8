"""The checkpoint memory tier of sharded state in real ``flexrun run`` jobs (issue 34): a
2-worker FSDP2 script with Adam saving every step through ``ShardedCheckpointer`` with
``durable_every=20`` resumes from the node's memory at the killed step after a kill -9 of
one worker, skips a rank's corrupted copy for the step before, and ends with model and
optimizer state bitwise equal to an uninterrupted run."""

from __future__ import annotations

import os
import random
import signal
from pathlib import Path
from typing import Any

import pytest
import test_train_memtier_run as memtier_run
import torch
from support import Procs, SharedRuns, read_events, wait_for
from train_support import HERE

WORKER = HERE / "memshard_worker.py"


def _job(procs: Procs, name: str, *script_args: str) -> Any:
    return memtier_run._job(procs, name, *script_args, worker=WORKER)


def _final(procs: Procs, name: str) -> dict[str, Any]:
    return torch.load(procs.tmp / f"final-{name}.pt", weights_only=True)  # type: ignore[no-any-return]


def _reference(shared: SharedRuns) -> dict[str, Any]:
    final = memtier_run._reference(shared, "memshard-ref", _job, wait_s=200)
    assert final["optim"]["state"], "the reference run has no optimizer state"
    return final


def _resumes(procs: Procs, rank: int) -> list[int]:
    return [r["resume"] for r in memtier_run._lines(procs, "job", rank) if "resume" in r]


@pytest.mark.timeout(500)
def test_kill_9_of_one_fsdp2_worker_resumes_at_the_killed_step_from_memory_bitwise(
    procs: Procs, shared_runs: SharedRuns
) -> None:
    ref = _reference(shared_runs)
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    # (never next to step 21, which durable storage holds too: a resume there could not
    # show that the shards came from memory; rehearsal Q drew it once)
    target, victim = rng.choice([*range(5, 18), *range(24, 31)]), rng.randrange(2)
    job = _job(procs, "job", "--step-sleep", "0.1")
    wait_for(lambda: memtier_run._last_step(procs, "job", victim) >= target, 200, f"step {target}")
    pid = memtier_run._lines(procs, "job", victim)[0]["pid"]
    os.kill(pid, signal.SIGKILL)
    killed_at = memtier_run._last_step(procs, "job", victim)
    assert procs.wait(job, 250) == 0, procs.stderr("job")
    for rank in (0, 1):
        resumes = _resumes(procs, rank)
        assert len(resumes) == 2 and resumes[0] == 0, (rank, resumes, seed)
        # At most one completed step is computed again (a step is logged before its save).
        assert killed_at - 1 <= resumes[1] <= killed_at, (resumes, killed_at, seed)
    loaded = memtier_run._loaded(procs, "job")
    assert loaded[-1]["restored_from"] == "memory", loaded
    assert loaded[-1]["step"] == _resumes(procs, 0)[1] and loaded[-1]["sharded"], loaded
    # Storage held only older steps (durable: 1 and 21), so the shards came from memory.
    durable = memtier_run._durable_steps(procs.tmp / "ck-job")
    assert 1 in durable and loaded[-1]["step"] not in durable, (durable, loaded)
    memtier_run._assert_bitwise_equal(ref, _final(procs, "job"), f"seed {seed} at {killed_at}")
    assert list(Path("/dev/shm").glob(f"flexrun-mem-*-{job.pid}")) == []


@pytest.mark.timeout(500)
def test_a_corrupted_copy_of_one_rank_is_skipped_and_the_step_before_used_bitwise(
    procs: Procs, shared_runs: SharedRuns
) -> None:
    ref = _reference(shared_runs)
    job = _job(procs, "job", "--corrupt-at", "13", "--corrupt-rank", "1")
    assert procs.wait(job, 250) == 0, procs.stderr("job")
    events = read_events(procs.tmp / "run-job")
    skipped = [e for e in events if e["event"] == "checkpoint_memory_skipped"]
    assert [(e["step"], e["rank"]) for e in skipped] == [(13, 1)], skipped
    assert "checksum mismatch" in skipped[0]["reason"], skipped
    # Rank 0's copy of 13 verifies, but rank 1 lacks one: both resume from 12.
    assert _resumes(procs, 0) == [0, 12] and _resumes(procs, 1) == [0, 12]
    loaded = memtier_run._loaded(procs, "job")
    assert loaded[-1]["restored_from"] == "memory" and loaded[-1]["step"] == 12, loaded
    memtier_run._assert_bitwise_equal(ref, _final(procs, "job"))
