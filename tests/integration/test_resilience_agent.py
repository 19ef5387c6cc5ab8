"""Hangs, crash loops and live mode's default budget, with real processes and scripts that
know nothing of flexrun (the worker's progress hook sees their steps)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from live_support import HB, LIVE_STEPS, live_workers, wait_step
from support import Procs, read_events, read_progress, wait_for

PLAIN = Path(__file__).parent / "scripts" / "plain_steps.py"


def _run(procs: Procs, name: str, *flags: str, script_args: tuple[str, ...] = ()):  # type: ignore[no-untyped-def]
    run_dir = procs.tmp / name
    agent = procs.start(
        [
            "run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--run-dir",
            str(run_dir),
            *flags,
            str(PLAIN),
            *script_args,
        ],
        name=name,
    )
    return agent, run_dir


@pytest.mark.timeout(150)
def test_a_crash_loop_exits_86_after_k_restarts(procs: Procs) -> None:
    agent, run_dir = _run(
        procs, "loop", "--max-restarts", "10", "--crash-loop-restarts", "2",
        script_args=("--fail-after", "0"),
    )  # fmt: skip
    assert agent.wait(timeout=140) == 86, procs.stderr("loop")[-3000:]
    err = procs.stderr("loop")
    assert "crash loop" in err and "exit code 86" in err
    events = read_events(run_dir)
    assert [e["event"] for e in events].count("failure") == 3  # the first run + K=2 restarts
    assert [e for e in events if e["event"] == "no_progress"]
    assert [e["exit_code"] for e in events if e["event"] == "job_finished"] == [86]


@pytest.mark.timeout(150)
def test_a_job_that_progressed_between_failures_is_no_crash_loop(procs: Procs) -> None:
    agent, run_dir = _run(
        procs, "prog", "--max-restarts", "2", "--crash-loop-restarts", "1",
        script_args=("--fail-after", "3"),
    )  # fmt: skip
    assert agent.wait(timeout=140) == 1, procs.stderr("prog")[-3000:]
    events = read_events(run_dir)
    assert [e["event"] for e in events].count("failure") == 3  # restarts exhausted
    assert not [e for e in events if e["event"] == "no_progress"]


@pytest.mark.timeout(150)
def test_a_plain_script_sleeping_forever_in_a_step_is_caught_and_recovers(procs: Procs) -> None:
    agent, run_dir = _run(
        procs, "hang", "--max-restarts", "1", "--hang-timeout", "3",
        script_args=("--hang-at", "10", "--marker", str(procs.tmp / "hung-once")),
    )  # fmt: skip
    assert agent.wait(timeout=140) == 0, procs.stderr("hang")[-3000:]
    events = read_events(run_dir)
    (hang,) = [e for e in events if e["event"] == "hang_detected"]
    # (rank 0 waits in DDP's backward, in C++: no Python collective frame tells it from the
    # sleeper, so either may be blamed; both are silent and both stacks are kept)
    assert hang["rank"] in (0, 1) and hang["steps"] >= 5 and hang["floor_s"] == 3.0
    assert hang["limit_s"] >= 3.0 and hang["cap_s"] >= hang["limit_s"]
    text = Path(hang["stacks_file"]).read_text()
    assert "sleep_forever_in_step" in text, text[:2000]
    assert text.count("=== rank") == 2  # both ranks' stacks (both have the hook)
    (fin,) = [e for e in events if e["event"] == "job_finished"]
    assert 0 < fin["productive_s"] < fin["wall_s"]
    # the hang's silence and the restart were lost; the start-up was not (overhead)
    assert fin["overhead_s"] > 0 and fin["ettr"] < fin["failure_ettr"] < 1, fin


@pytest.mark.timeout(150)
def test_a_rank_stuck_in_a_collective_behind_a_stopped_peer_is_caught(procs: Procs) -> None:
    progress = procs.tmp / "p.jsonl"
    agent, run_dir = _run(
        procs, "stop", "--max-restarts", "1", "--hang-timeout", "3",
        script_args=("--steps", "150", "--progress", str(progress)),
    )  # fmt: skip
    wait_for(lambda: len(read_progress(progress)) >= 20, 90, "20 steps")
    (victim,) = {r["pid"] for r in read_progress(progress) if r["rank"] == 1}
    os.kill(victim, signal.SIGSTOP)
    assert agent.wait(timeout=130) == 0, procs.stderr("stop")[-3000:]
    hangs = [e for e in read_events(run_dir) if e["event"] == "hang_detected"]
    assert len(hangs) == 1 and set(hangs[0]["silent_ranks"]) <= {0, 1}
    assert max(r["step"] for r in read_progress(progress)) == 149


@pytest.mark.timeout(150)
def test_a_20s_first_step_is_not_a_hang(procs: Procs) -> None:
    agent, run_dir = _run(
        procs, "slow", "--max-restarts", "0", "--hang-timeout", "3",
        script_args=("--steps", "10", "--first-step-sleep", "20"),
    )  # fmt: skip
    assert agent.wait(timeout=140) == 0, procs.stderr("slow")[-3000:]
    events = read_events(run_dir)
    assert not [e for e in events if e["event"] == "hang_detected"]
    (fin,) = [e for e in events if e["event"] == "job_finished"]
    assert fin["productive_s"] < fin["wall_s"] - 15  # the first step's 20 s are not productive
    # ... but nothing disrupted the job: all of the rest is overhead, none of it lost
    assert fin["overhead_s"] > 15 and fin["failure_ettr"] >= 0.999, fin


@pytest.mark.timeout(300)
def test_live_mode_default_budget_survives_a_stopped_and_a_killed_worker(procs: Procs) -> None:
    # (live_support.start_live passes --max-restarts 10: here, no restart flag at all)
    run = procs.tmp / "live"
    run.mkdir()
    agent = procs.start(
        [
            "run", "--standalone", "--nproc-per-node", "3", "--mode", "live",
            "--warm-spares", "1", "--rdzv-conf", HB, "--run-dir", str(run / "run"),
            str(LIVE_STEPS), "--steps", "400", "--step-time", "0.05",
            "--progress", str(run / "p.jsonl"),
        ],
        name="live",
    )  # fmt: skip
    pids = live_workers(run / "run", 3)
    wait_step(run, 20)
    os.kill(pids[1], signal.SIGSTOP)
    wait_for(
        lambda: any(e["event"] == "hang_detected" for e in read_events(run / "run")),
        30,
        "the stopped worker to be caught",
    )
    time.sleep(1.0)
    os.kill(pids[2], signal.SIGKILL)
    assert agent.wait(timeout=240) == 0, procs.stderr("live")[-3000:]
    events = read_events(run / "run")
    assert len([e for e in events if e["event"] == "worker_exited" and e["exit_code"]]) >= 2
    assert [e for e in events if e["event"] == "failure"]
    assert "restarts_exhausted" not in procs.stderr("live")


@pytest.fixture
def full_tmpfs(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A 256 KiB tmpfs, filled to the last byte (root only)."""
    mnt = tmp_path / "full"
    mnt.mkdir()
    rc = os.system(f"mount -t tmpfs -o size=256k tmpfs {mnt} 2>/dev/null")
    if rc != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        with open(mnt / "fill", "wb", buffering=0) as fh:
            try:
                while True:
                    fh.write(b"\0" * 4096)
                    fh.flush()
            except OSError:
                pass  # (full: that is the point)
        yield mnt
    finally:
        os.system(f"umount -l {mnt}")


@pytest.mark.timeout(150)
def test_a_run_directory_on_a_full_disk_does_not_stop_the_agent(procs: Procs, full_tmpfs) -> None:  # type: ignore[no-untyped-def]
    # The script prints nothing: the workers' own output on a full disk is proc/'s part.
    agent = procs.start(
        [
            "run", "--standalone", "--nproc-per-node", "2", "--warm-spares", "0",
            "--max-restarts", "1", "--run-dir", str(full_tmpfs / "run"),
            str(PLAIN), "--steps", "30", "--fail-after", "10",
        ],
        name="full",
    )  # fmt: skip
    # rank 0 fails once per attempt: the failure paths (events, root cause) run too
    assert agent.wait(timeout=140) == 1, procs.stderr("full")[-3000:]
    err = procs.stderr("full")
    assert "flexrun/events.py" not in err and "Errno 28" not in err, err[-3000:]
    assert err.count("cannot write the event log") == 1
    assert "restarts exhausted" in err


@pytest.mark.timeout(150)
def test_a_job_on_a_full_disk_trains_to_the_end(procs: Procs, full_tmpfs) -> None:  # type: ignore[no-untyped-def]
    progress = procs.tmp / "p.jsonl"  # (on a disk with space: what the test reads)
    agent = procs.start(
        [
            "run", "--standalone", "--nproc-per-node", "2", "--warm-spares", "0",
            "--run-dir", str(full_tmpfs / "run"),
            str(PLAIN), "--steps", "30", "--progress", str(progress),
        ],
        name="fullok",
    )  # fmt: skip
    assert agent.wait(timeout=140) == 0, procs.stderr("fullok")[-3000:]
    assert max(r["step"] for r in read_progress(progress)) == 29


@pytest.mark.timeout(200)
def test_a_live_job_on_a_full_disk_trains_to_the_end(procs: Procs, full_tmpfs) -> None:  # type: ignore[no-untyped-def]
    # Live mode keeps more in the run directory than restart mode (heartbeat files, epoch
    # records, the spares' logs): none of it may stop a job whose disk is full.
    progress = procs.tmp / "p.jsonl"  # (on a disk with space: what the test reads)
    agent = procs.start(
        [
            "run", "--standalone", "--nproc-per-node", "2", "--mode", "live",
            "--warm-spares", "1", "--run-dir", str(full_tmpfs / "run"),
            str(LIVE_STEPS), "--steps", "60", "--step-time", "0.05", "--progress", str(progress),
        ],
        name="livefull",
    )  # fmt: skip
    assert agent.wait(timeout=180) == 0, procs.stderr("livefull")[-3000:]
    rows = read_progress(progress)
    assert max(r["step"] for r in rows if "step" in r) == 59, rows[-3:]
    assert sorted(r["rank"] for r in rows if r.get("done")) == [0, 1]
    err = procs.stderr("livefull")
    assert "cannot write the job secret" in err  # (it went to memory instead)
    assert "Traceback" not in err and "Errno 28" not in err, err[-3000:]
