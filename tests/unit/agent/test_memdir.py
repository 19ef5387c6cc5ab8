"""The agent's memory directory: created private, handed to workers, removed, and what
killed agents left swept (only theirs: a live agent's directory stays)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from flexrun.agent import memdir
from flexrun.agent.spec import worker_envs
from flexrun.rendezvous.state import MasterRecord, Member, RoundRecord


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(timeout=30)
    return p.pid


@pytest.mark.timeout(30)
def test_create_makes_a_private_directory_per_agent_and_remove_deletes_it(tmp_path: Path) -> None:
    d = memdir.create_memory_dir("run/1", "node a", root=tmp_path)
    assert d is not None and d.is_dir()
    assert d.name == f"flexrun-mem-run_1-node_a-{os.getpid()}"
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    (d / "ckpt-x").mkdir()
    (d / "ckpt-x" / "step_3.mem").write_bytes(b"x")
    memdir.remove_memory_dir(d)
    assert not d.exists()
    memdir.remove_memory_dir(d)  # idempotent


@pytest.mark.timeout(30)
def test_sweep_removes_only_directories_of_agents_that_are_gone(tmp_path: Path) -> None:
    dead = tmp_path / f"flexrun-mem-r-n-{_dead_pid()}"
    (dead / "ckpt-y").mkdir(parents=True)
    alive = tmp_path / f"flexrun-mem-r-n-{os.getppid()}"
    alive.mkdir()
    other = tmp_path / "unrelated-123"
    other.mkdir()
    made = memdir.create_memory_dir("r", "n", root=tmp_path)  # sweeps first
    assert made is not None
    assert not dead.exists()
    assert alive.is_dir() and other.is_dir() and made.is_dir()


def test_without_the_memory_filesystem_there_is_no_directory(tmp_path: Path) -> None:
    assert memdir.create_memory_dir("r", "n", root=tmp_path / "absent") is None


def test_workers_are_told_the_directory(tmp_path: Path) -> None:
    rnd = RoundRecord(number=1, state="running", members=(Member("n", "10.1.2.3", 2),))
    kw = dict(
        base={},
        rnd=rnd,
        node_id="n",
        nproc=2,
        master=MasterRecord("10.1.2.3", 1234),
        role="default",
        run_id="r",
        run_dir=tmp_path,
        restart_count=0,
        max_restarts=0,
    )
    envs = worker_envs(**kw, memory_dir=tmp_path / "m")  # type: ignore[arg-type]
    assert [e["FLEXRUN_MEMORY_DIR"] for e in envs] == [str(tmp_path / "m")] * 2
    assert all("FLEXRUN_MEMORY_DIR" not in e for e in worker_envs(**kw))  # type: ignore[arg-type]
