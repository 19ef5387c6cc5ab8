"""The agent with real processes on one node: training, failures, signals, cleanup."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from pathlib import Path

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


def _worker_pids(
    agent_pid: int, n: int, timeout: float = 60, script: str = "ddp_steps.py"
) -> list[int]:
    def find() -> list[int] | None:
        kids = [p for p in descendants(agent_pid) if script in " ".join(p.cmdline())]
        return [p.pid for p in kids] if len(kids) >= n else None

    return wait_for(find, timeout, f"{n} workers")  # type: ignore[return-value]


@pytest.mark.timeout(120)
def test_unmodified_torchrun_script_trains_to_completion(procs: Procs) -> None:
    progress = procs.tmp / "progress.jsonl"
    agent = procs.start(
        [
            "run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "--run-dir",
            str(procs.tmp / "run"),
            str(DDP_STEPS),
            "--steps",
            "10",
            "--progress",
            str(progress),
        ],
        name="agent",
    )
    assert agent.wait(timeout=100) == 0, procs.stderr("agent")
    rows = read_progress(progress)
    assert sorted({(r["rank"], r["step"]) for r in rows}) == [
        (r, s) for r in range(2) for s in range(10)
    ]
    assert {r["world"] for r in rows} == {2}
    events = {e["event"] for e in read_events(procs.tmp / "run")}
    assert {"rendezvous_completed", "worker_started", "worker_exited", "job_finished"} <= events


def _cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:  # (it ended since it was listed)
        return ""


def _parent(pid: int) -> psutil.Process:
    parent = psutil.Process(pid).parent()
    assert parent is not None, pid
    return parent


@pytest.mark.timeout(180)
def test_first_workers_come_from_the_warm_pool_unless_stdin_could_carry_something(
    procs: Procs,
) -> None:
    """Restart mode, one node: with stdin /dev/null the first workers are forks of the
    pool's zygote (one import torch for all) showing the script's command line; with a pipe
    they start cold, children of the agent, and inherit it (as torchrun's)."""
    agents = {}
    for how, stdin in (("null", subprocess.DEVNULL), ("pipe", subprocess.PIPE)):
        agents[how] = procs.start(
            [
                "run",
                "--standalone",
                "--nproc-per-node",
                "2",
                "--run-dir",
                str(procs.tmp / how),
                str(DDP_STEPS),
                "--steps",
                "80",
                "--step-time",
                "0.1",
                "--progress",
                str(procs.tmp / f"{how}.jsonl"),
            ],
            name=how,
            stdin=stdin,
        )
    parents = {}
    for how, agent in agents.items():
        pids = _worker_pids(agent.pid, 2)
        parents[how] = {" ".join(_parent(pid).cmdline()) for pid in pids}
        assert all(f"-u {DDP_STEPS} --steps 80" in " ".join(psutil.Process(p).cmdline())
                   for p in pids)  # fmt: skip
    assert len(parents["null"]) == 1 and "flexrun.spares.spare --fork-server" in next(
        iter(parents["null"])
    ), parents
    assert len(parents["pipe"]) == 1 and "flexrun run" in next(iter(parents["pipe"])), parents
    for how, agent in agents.items():
        if agent.stdin is not None:
            agent.stdin.close()
        assert agent.wait(timeout=120) == 0, procs.stderr(how)[-3000:]


@pytest.mark.timeout(120)
def test_a_script_of_the_standard_library_only_starts_cold_and_gets_no_pool(
    procs: Procs,
) -> None:
    """Restart mode, one node, stdin /dev/null, default flags: a script that imports only
    the standard library starts its workers cold, children of the agent, and no zygote runs
    (its ``import torch`` would serve none of them), not even after the pool's delay."""
    script = procs.tmp / "stdlib_only.py"
    script.write_text("import os, sys, time\nprint(os.environ['RANK'])\ntime.sleep(5)\n")
    agent = procs.start(
        ["run", "--standalone", "--nproc-per-node", "2", "--run-dir", str(procs.tmp / "r"),
         str(script)],
        name="a",
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    pids = _worker_pids(agent.pid, 2, script=script.name)
    assert {" ".join(_parent(p).cmdline()).count("flexrun run") for p in pids} == {1}
    deadline = time.monotonic() + 4.0  # (past restart mode's 3 s delay before a pool fills)
    while time.monotonic() < deadline and agent.poll() is None:
        spares = [p for p in descendants(agent.pid) if "flexrun.spares" in _cmdline(p)]
        assert not spares, spares
        time.sleep(0.2)
    assert agent.wait(timeout=60) == 0, procs.stderr("a")[-3000:]
    assert not (procs.tmp / "r" / "logs" / "spares").exists()


def _attempt_rows(progress: Path, attempt: int) -> dict[int, list[dict]]:
    """Each rank's progress rows of ``attempt`` (the script logs it as a string)."""
    out: dict[int, list[dict]] = {}
    for r in read_progress(progress):
        if int(r["attempt"]) == attempt:
            out.setdefault(r["rank"], []).append(r)
    return out


def _next_attempt(progress: Path, after: int, timeout: float = 120) -> int:
    """The first attempt numbered above ``after`` in which all four ranks trained a step."""

    def find() -> int | None:
        seen = {int(r["attempt"]) for r in read_progress(progress)}
        return next(
            (a for a in sorted(seen) if a > after and len(_attempt_rows(progress, a)) == 4), None
        )

    return wait_for(find, timeout, f"an attempt after {after} with four ranks stepping")  # type: ignore[return-value]


@pytest.mark.timeout(900)
def test_kill_9_of_one_of_four_workers_recovers_20_times_out_of_20(procs: Procs) -> None:
    """Twenty kill -9s of a random one of four workers, five in each of four jobs: each
    kill comes once every rank of the attempt before it trains, and is one recovery of its
    own (every local worker restarted from the last checkpoint, the killed ones gone);
    the job then finishes every step. Twice, the kill waits for a full warm pool, and the
    restart must take its spares. (A job's start-up is not what this tests: five kills per
    job spare sixteen agent and zygote start-ups.)"""
    rng = random.Random(7)
    recoveries = 0
    for job in range(4):
        progress = procs.tmp / f"progress{job}.jsonl"
        name = f"agent{job}"
        agent = procs.start(
            ["run", "--standalone", "--nproc-per-node", "4", "--max-restarts", "5",
             "--run-dir", str(procs.tmp / f"run{job}"), str(DDP_STEPS), "--steps", "60",
             "--step-time", "0.05", "--ckpt", str(procs.tmp / f"ckpt{job}.pt"),
             "--ckpt-every", "2", "--progress", str(progress)],
            name=name,
        )  # fmt: skip
        attempt = _next_attempt(progress, -1)
        for kill in range(5):
            pids = [rows[-1]["pid"] for rows in _attempt_rows(progress, attempt).values()]
            warm = job % 2 == 1 and kill == 4
            if warm:
                spares_dir = procs.tmp / f"run{job}" / "logs" / "spares"
                wait_for(
                    lambda d=spares_dir: len(list(d.glob("*.ready"))) >= 4, 60, "4 ready spares"
                )
                spare_pids = {
                    p.pid
                    for p in descendants(agent.pid)
                    if "flexrun.spares.spare" in " ".join(p.cmdline())
                }
            os.kill(rng.choice(pids), signal.SIGKILL)
            where = f"job {job}, kill {kill}: {procs.stderr(name)[-3000:]}"
            assert agent.poll() is None, where
            attempt = _next_attempt(progress, attempt)
            recoveries += 1
            wait_for(lambda p=pids: alive_pids(p) == [], 30, "the old workers gone")
            restarted = {rows[0]["pid"] for rows in _attempt_rows(progress, attempt).values()}
            assert not restarted & set(pids), where
            if warm:
                assert restarted <= spare_pids, f"{where}: the restart did not use the warm spares"
        assert agent.wait(timeout=120) == 0, f"job {job}: {procs.stderr(name)[-3000:]}"
        final = _attempt_rows(progress, attempt)
        assert {rank: rows[-1]["step"] for rank, rows in final.items()} == dict.fromkeys(
            range(4), 59
        )
    assert recoveries == 20


@pytest.mark.timeout(120)
def test_max_restarts_2_with_a_failing_script_exits_1_after_exactly_3_attempts(
    procs: Procs,
) -> None:
    run_dir = procs.tmp / "run"
    agent = procs.start(
        [
            "run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "2",
            "--run-dir",
            str(run_dir),
            str(DDP_STEPS),
            "--fail-rank",
            "1",
        ],
        name="agent",
    )
    assert agent.wait(timeout=100) == 1
    err = procs.stderr("agent")
    assert "rank 1" in err and "ValueError: deliberate failure on rank 1" in err
    events = read_events(run_dir)
    failures = [e for e in events if e["event"] == "failure"]
    assert len(failures) == 3
    assert all(f["rank"] == 1 and "ValueError" in f["message"] for f in failures)
    assert len({e["round"] for e in events if e["event"] == "rendezvous_completed"}) == 3
    assert [e["event"] for e in events].count("restart") == 2


@pytest.mark.timeout(120)
def test_sigterm_to_agent_forwards_to_workers_and_exits_143_leaving_nothing(procs: Procs) -> None:
    marker = procs.tmp / "sigterm"
    progress = procs.tmp / "progress.jsonl"
    agent = procs.start(
        [
            "run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--stop-grace",
            "10",
            "--run-dir",
            str(procs.tmp / "run"),
            *endless(DDP_STEPS, progress),
            "--on-sigterm",
            str(marker),
        ],
        name="agent",
    )
    pids = _worker_pids(agent.pid, 2)
    wait_for(lambda: read_progress(progress), 60, "training to start")
    tree = [p.pid for p in descendants(agent.pid)]
    agent.send_signal(signal.SIGTERM)
    assert agent.wait(timeout=30) == 143
    for rank in range(2):
        assert (procs.tmp / f"sigterm.{rank}").exists(), "worker did not receive SIGTERM"
    assert alive_pids(tree + pids) == []
    assert any(e["event"] == "preempted" for e in read_events(procs.tmp / "run"))


@pytest.mark.timeout(120)
def test_kill_9_of_a_standalone_agent_leaves_no_orphaned_worker(procs: Procs) -> None:
    progress = procs.tmp / "progress.jsonl"
    agent = procs.start(
        [
            "run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--run-dir",
            str(procs.tmp / "run"),
            str(DDP_STEPS),
            "--steps",
            "100000",
            "--progress",
            str(progress),
        ],
        name="agent",
    )
    pids = _worker_pids(agent.pid, 2)
    wait_for(lambda: read_progress(progress), 60, "training to start")
    os.kill(agent.pid, signal.SIGKILL)
    agent.wait(timeout=10)
    wait_for(lambda: alive_pids(pids) == [], 5, "workers to die with their agent")


@pytest.mark.timeout(60)
def test_workers_see_the_full_torchrun_environment(procs: Procs) -> None:
    script = procs.tmp / "env.py"
    script.write_text(
        "import json, os, sys\n"
        "keys = ['RANK','LOCAL_RANK','WORLD_SIZE','LOCAL_WORLD_SIZE','GROUP_RANK','GROUP_WORLD_SIZE',"
        "'ROLE_NAME','ROLE_RANK','ROLE_WORLD_SIZE','MASTER_ADDR','MASTER_PORT','TORCHELASTIC_RESTART_COUNT',"
        "'TORCHELASTIC_MAX_RESTARTS','TORCHELASTIC_RUN_ID','TORCHELASTIC_ERROR_FILE',"
        "'TORCH_NCCL_ASYNC_ERROR_HANDLING','OMP_NUM_THREADS','FLEXRUN_ROUND','FLEXRUN_RUN_DIR']\n"
        "json.dump({k: os.environ.get(k) for k in keys}, open(sys.argv[1] + os.environ['RANK'], 'w'))\n"
    )
    agent = procs.start(
        [
            "run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            "--role",
            "trainer",
            "--rdzv-id",
            "envjob",
            "--run-dir",
            str(procs.tmp / "run"),
            str(script),
            str(procs.tmp / "env"),
        ],
        name="agent",
    )
    assert agent.wait(timeout=50) == 0, procs.stderr("agent")
    import json

    envs = [json.loads((procs.tmp / f"env{r}").read_text()) for r in range(2)]
    for r, env in enumerate(envs):
        assert env["RANK"] == env["LOCAL_RANK"] == env["ROLE_RANK"] == str(r)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == env["ROLE_WORLD_SIZE"] == "2"
        assert env["GROUP_RANK"] == "0" and env["GROUP_WORLD_SIZE"] == "1"
        assert env["ROLE_NAME"] == "trainer" and env["TORCHELASTIC_RUN_ID"] == "envjob"
        assert env["TORCHELASTIC_RESTART_COUNT"] == "0" and env["TORCHELASTIC_MAX_RESTARTS"] == "1"
        assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1" and env["OMP_NUM_THREADS"] == "1"
        assert env["MASTER_ADDR"] and int(env["MASTER_PORT"]) > 0
        assert env["TORCHELASTIC_ERROR_FILE"].endswith("error.json") and env["FLEXRUN_ROUND"] == "1"
    assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"]


@pytest.mark.timeout(60)
def test_module_and_no_python_entrypoints(procs: Procs) -> None:
    pkg = procs.tmp / "mymod.py"
    pkg.write_text("import os; open('mod' + os.environ['RANK'], 'w').write('ok')\n")
    agent = procs.start(
        ["run", "--standalone", "--nproc-per-node", "2", "-m", "mymod"],
        name="m",
        env={"PYTHONPATH": str(procs.tmp)},
    )
    assert agent.wait(timeout=50) == 0, procs.stderr("m")
    assert (procs.tmp / "mod0").exists() and (procs.tmp / "mod1").exists()
    agent = procs.start(
        ["run", "--standalone", "--no-python", "sh", "-c", "echo hi > nopy$RANK"], name="n"
    )
    assert agent.wait(timeout=50) == 0, procs.stderr("n")
    assert (procs.tmp / "nopy0").read_text().strip() == "hi"
    _ = psutil, time


@pytest.mark.timeout(180)
def test_a_worker_that_sleeps_forever_in_a_step_is_caught_with_its_stack_and_the_job_recovers(
    procs: Procs,
) -> None:
    run_dir = procs.tmp / "run"
    script = DDP_STEPS.parent / "hang_steps.py"
    agent = procs.start(
        [
            "run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            "--hang-timeout",
            "3",
            "--run-dir",
            str(run_dir),
            str(script),
            "--marker",
            str(procs.tmp / "hung-once"),
        ],
        name="agent",
    )
    assert agent.wait(timeout=150) == 0, procs.stderr("agent")[-3000:]
    hangs = [e for e in read_events(run_dir) if e["event"] == "hang_detected"]
    assert len(hangs) == 1 and hangs[0]["rank"] == 1
    stacks = (run_dir / "hangs").glob("*.txt")
    text = "".join(p.read_text() for p in stacks)
    assert "sleep_forever_in_step" in text, text[:2000]
    failures = [e for e in read_events(run_dir) if e["event"] == "failure"]
    assert failures and "hang" in failures[0]["message"]
