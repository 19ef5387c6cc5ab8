"""Crash consistency on S3 (issue 19's acceptance): kill -9 at random instants during a
persist, and a 2-rank ``flexrun run`` job killed three times and resumed bitwise."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from s3_support import S3
from test_train_resume import _assert_bitwise_equal
from train_support import HERE, REPO, read_jsonl, wait_until

DRIVER = HERE / "crash_driver.py"
WORKER = HERE / "s3_train_worker.py"


@pytest.mark.timeout(240)
def test_kill_9_at_random_instants_during_a_persist_to_s3_never_tears_a_checkpoint(
    s3: S3, tmp_path: Path
) -> None:
    seed = random.randrange(1 << 30)
    env = dict(os.environ, OMP_NUM_THREADS="1", **s3.env())
    out = subprocess.run(
        [sys.executable, str(DRIVER), "random", s3.url("crash"), "20", str(seed), "0.3", "1.5"],
        capture_output=True,
        text=True,
        timeout=220,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])["results"]
    assert len(results) == 20
    steps = [r["step"] for r in results]
    # Every load after a kill found a complete checkpoint that verified (the driver checks
    # that every tensor holds the step it was saved at): nothing torn is ever visible.
    assert all(r["skipped"] == [] for r in results), (seed, results)
    # How many launches die before the first save commits depends on how long start-up
    # takes (at load 12 on 2 cores: 13 of 20); once one has, every later launch finds one.
    first = next((i for i, s in enumerate(steps) if s is not None), None)
    assert first is not None and first <= len(steps) - 3, (seed, results)
    assert all(s is not None for s in steps[first:]), (seed, results)
    assert steps[first:] == sorted(steps[first:]), (seed, results)  # always forward
    assert sum(r["mid_save"] for r in results) >= 5, (seed, results)  # kills hit persists
    assert s3.uploads("crash/") == [] or not results[-1]["incomplete_upload"]


def _flexrun(
    args: list[str], run_dir: Path, env: dict[str, str], log: Path
) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "flexrun", "run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["--run-dir", str(run_dir), *args]
    with log.open("ab") as fh:
        return subprocess.Popen(
            cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True
        )


def _events(run_dir: Path, name: str) -> list[dict]:
    return [e for e in read_jsonl(run_dir / "events.jsonl") if e.get("event") == name]


def _progress(log: Path) -> tuple[int, int, int]:
    """(launches so far, step the newest resumed from, last step it logged), from rank
    0's sample log."""
    launches, resume, last = 0, -1, 0
    for r in read_jsonl(Path(f"{log}.rank0")):
        if "resume" in r:
            launches, resume, last = launches + 1, r["resume"], r["resume"]
        elif "step" in r:
            last = r["step"]
    return launches, resume, last


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.timeout(420)
def test_a_2_rank_flexrun_job_on_s3_killed_three_times_resumes_bitwise_equal(
    s3: S3, tmp_path: Path
) -> None:
    steps = 90  # (room for three kills, each after a save reached S3)
    common = ["--steps", str(steps), "--ckpt-every", "5", "--global-batch", "48"]
    common += ["--micro-batch", "8", "--dropout", "0.2", "--step-sleep", "0.05"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **s3.env())
    procs: list[subprocess.Popen[bytes]] = []
    try:
        ref = _flexrun(
            [
                str(WORKER),
                *common,
                "--ckpt-dir",
                s3.url("ref"),
                "--final-state",
                str(tmp_path / "ref.pt"),
            ],
            tmp_path / "ref-run",
            env,
            tmp_path / "ref.log",
        )
        procs.append(ref)
        assert ref.wait(180) == 0, (tmp_path / "ref.log").read_text()[-4000:]

        rng = random.Random()
        seed = rng.randrange(1 << 30)
        rng.seed(seed)
        samples = tmp_path / "samples"
        args = [str(WORKER), *common, "--ckpt-dir", s3.url("ck"), "--sample-log", str(samples)]
        args += ["--final-state", str(tmp_path / "final.pt")]
        kills: list[tuple[str, int, int]] = []
        first_run = tmp_path / "run1"
        job = _flexrun(["--max-restarts", "3", *args], first_run, env, tmp_path / "job1.log")
        procs.append(job)
        for attempt in range(3):
            # This round's workers resumed and trained a step: kill at a random later step.
            wait_until(
                lambda a=attempt: (
                    _progress(samples)[0] > a and _progress(samples)[2] > _progress(samples)[1]
                ),
                120,
                f"launch {attempt + 1} to train",
            )
            _, resume, _ = _progress(samples)
            # ... once this launch committed a checkpoint to S3: its persist is
            # asynchronous, and on a loaded machine one can still be in flight steps later
            # (a kill then rightly resumes from an older one, and the run tests nothing new).
            wait_until(
                lambda r=resume: [
                    e for e in _events(first_run, "checkpoint_saved") if e["step"] > r
                ],
                120,
                f"a checkpoint after step {resume} on S3",
            )
            low = max(resume + 7, _progress(samples)[2])
            target = rng.randint(low, max(low, min(resume + 15, steps - 5)))
            wait_until(lambda t=target: _progress(samples)[2] >= t, 120, f"step {target}")
            pids = [int(e["pid"]) for e in _events(first_run, "worker_started")[-2:]]
            if attempt < 2:  # a worker dies: flexrun restarts the round, resuming from S3
                os.kill(rng.choice(pids), signal.SIGKILL)
                kills.append(("worker", resume, _progress(samples)[2]))
            else:  # the whole job dies: agent and workers at once
                os.killpg(job.pid, signal.SIGKILL)
                job.wait(30)
                kills.append(("job", resume, _progress(samples)[2]))
                wait_until(lambda g=pids: not any(_alive(p) for p in g), 30, "workers to die")
        # A new run of the job (a new run id: the fence takes a new epoch) resumes from S3.
        second_run = tmp_path / "run2"
        again = _flexrun(args, second_run, env, tmp_path / "job2.log")
        procs.append(again)
        assert again.wait(180) == 0, (tmp_path / "job2.log").read_text()[-4000:]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(30)

    a = torch.load(tmp_path / "ref.pt", weights_only=True)
    b = torch.load(tmp_path / "final.pt", weights_only=True)
    assert a["step"] == b["step"] == steps
    try:
        _assert_bitwise_equal(a["model"], b["model"], "model")
        _assert_bitwise_equal(a["optim"], b["optim"], "optim")
    except AssertionError as exc:
        raise AssertionError(
            f"not bitwise identical at {exc} (seed {seed}, kills {kills})"
        ) from None
    for run_dir in (tmp_path / "ref-run", first_run, second_run):
        assert _events(run_dir, "checkpoint_save_failed") == [], run_dir
    resumed = [e["step"] for e in _events(first_run, "checkpoint_loaded")]
    resumed += [e["step"] for e in _events(second_run, "checkpoint_loaded")]
    # Each kill came after a checkpoint newer than its launch's resume was on S3: every
    # relaunch resumed from a newer step than the launch before it.
    assert len(resumed) == 3 and resumed[0] > 0, (resumed, kills)
    assert all(r > k[1] for r, k in zip(resumed, kills, strict=True)), (resumed, kills)
    assert all(resume < killed for _, resume, killed in kills), kills
    assert s3.uploads("ck/") == []
