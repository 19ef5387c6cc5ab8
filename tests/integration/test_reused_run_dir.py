"""Issue 18 point 7: a reused run directory never blames yesterday's error.

The run directory (the default ``./flexrun-runs/<rdzv-id>``, or a ``--run-dir`` given
again) holds yesterday's logs: a rank's ``stderr.log`` ending in ``ValueError: OLD ERROR
from yesterday``, its ``stdout.log``, and yesterday's ``error.json``. Today's worker ends
with ``os._exit(3)``, leaving no traceback. The root cause on flexrun's stderr, in the
``failure`` event and in the FAILED round record on the store names exit code 3, never
the old error; the console (``--tee 3``) shows only today's lines.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path

import pytest
from support import (
    DDP_STEPS,
    Procs,
    descendants,
    free_port,
    node_args,
    read_events,
    read_progress,
    wait_for,
)

from flexrun.rendezvous.state import FAILED, Keys, RoundRecord
from flexrun.store.tcp import TcpStore

OLD = "ValueError: OLD ERROR from yesterday"
SCRIPT = (
    "import os, sys\n"
    "print('NEW stdout line', flush=True)\n"
    "print('NEW stderr line', file=sys.stderr, flush=True)\n"
    "os._exit(3)\n"
)


def _yesterday(run_dir: Path) -> None:
    rank = run_dir / "logs" / "round_1" / "rank_0"
    rank.mkdir(parents=True)
    (rank / "stderr.log").write_text(
        f'Traceback (most recent call last):\n  File "train.py", line 1, in <module>\n{OLD}\n'
    )
    (rank / "stdout.log").write_text("OLD stdout line from yesterday\n")
    (rank / "error.json").write_text(
        json.dumps({"message": {"message": OLD, "extraInfo": {"py_callstack": OLD}}})
    )


def _check_today(procs: Procs, run_dir: Path, name: str) -> None:
    err, out = procs.stderr(name), (procs.tmp / f"{name}.out").read_text()
    assert "OLD" not in err and "OLD" not in out, err + out  # no old line, no old cause
    assert "exited with code 3" in err and "NEW stderr line" in err, err
    assert "NEW stdout line" in out, out
    failures = [e for e in read_events(run_dir) if e["event"] == "failure"]
    assert failures and all("OLD" not in json.dumps(e) for e in failures), failures
    assert failures[-1]["exit_code"] == 3


@pytest.mark.timeout(180)
def test_the_default_run_dir_of_a_reused_rdzv_id_blames_only_todays_exit(procs: Procs) -> None:
    _yesterday(procs.tmp / "flexrun-runs" / "yesterday")
    (procs.tmp / "exit3.py").write_text(SCRIPT)
    p = procs.start(
        [
            "run",
            "--standalone",
            "--rdzv-id",
            "yesterday",
            "--max-restarts",
            "0",
            "--tee",
            "3",
            "exit3.py",
        ],
        name="a",
    )
    assert p.wait(timeout=150) == 3, procs.stderr("a")
    _check_today(procs, procs.tmp / "flexrun-runs" / "yesterday", "a")


@pytest.mark.timeout(180)
def test_the_failed_round_on_the_store_names_todays_cause(procs: Procs) -> None:
    port = free_port()
    procs.start(["store", "--host", "127.0.0.1", "--port", str(port)], name="store")
    wait_for(lambda: "listening" in (procs.tmp / "store.out").read_text(), 30, "the store")
    run_dir = procs.tmp / "run-a"
    _yesterday(run_dir)
    (procs.tmp / "exit3.py").write_text(SCRIPT)
    p = procs.start(
        [
            *node_args(f"127.0.0.1:{port}", "a", run_dir, nproc=1, nnodes="1:2"),
            "--max-restarts",
            "0",
            "--tee",
            "3",
            "exit3.py",
        ],
        name="a",
        env={"FLEXRUN_JOB_SECRET_FILE": "", "FLEXRUN_JOB_SECRET": ""},
    )
    assert p.wait(timeout=150) == 3, procs.stderr("a")
    _check_today(procs, run_dir, "a")
    store = TcpStore("127.0.0.1", port, connect_timeout_s=10)
    try:
        entry = store.get(Keys("job").round)
        assert entry is not None
        rnd = RoundRecord.decode(entry.value)
    finally:
        store.close()
    assert rnd.state == FAILED and rnd.root_cause is not None, rnd
    assert rnd.root_cause.exit_code == 3 and "OLD" not in json.dumps(rnd.root_cause.to_dict())


@pytest.mark.timeout(240)
def test_a_relaunch_after_a_killed_run_declares_no_hang_and_spends_no_restart(
    procs: Procs,
) -> None:
    """Issue 37 point 5: a run SIGKILLed mid-training (agent and workers: no teardown)
    leaves its ``round_1/rank_0/progress`` with an old mtime and its step count; the
    relaunch with the same rdzv id (a requeued Slurm job keeps its id) starts round 1 again
    in the same directory. It must not read that file as its own worker's silence."""
    progress, ckpt = procs.tmp / "progress.jsonl", procs.tmp / "ckpt.pt"
    args = [
        "run", "--rdzv-id", "requeued", "--nproc-per-node", "1", "--max-restarts", "0",
        "--hang-timeout", "2",
        str(DDP_STEPS), "--steps", "40", "--step-time", "0.2", "--progress", str(progress),
        "--ckpt", str(ckpt), "--ckpt-every", "5",
    ]  # fmt: skip
    first = procs.start(args, name="first")
    wait_for(lambda: ckpt.exists() and len(read_progress(progress)) >= 12, 150, "steps")
    tree = [first.pid, *(p.pid for p in descendants(first.pid))]
    for pid in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    first.wait(timeout=30)
    run_dir = procs.tmp / "flexrun-runs" / "requeued"
    stale = run_dir / "logs" / "round_1" / "rank_0" / "progress"
    assert stale.exists()  # what the killed run left
    # The stale file is as old as a long outage would leave it (a requeue waits minutes).
    os.utime(stale, (time.time() - 600, time.time() - 600))
    relaunched_at = time.time()
    second = procs.start(args, name="second")
    assert procs.wait(second, 180) == 0, procs.stderr("second")
    err = procs.stderr("second")
    assert "no progress" not in err and "did not answer" not in err, err
    later = [e for e in read_events(run_dir) if e["ts"] >= relaunched_at]
    assert not [e for e in later if e["event"] in ("hang_detected", "failure")], later
    steps = [ln["step"] for ln in read_progress(progress) if ln["ts"] >= relaunched_at]
    assert steps[0] > 0 and steps[-1] == 39, steps  # resumed from the checkpoint
