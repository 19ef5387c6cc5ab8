"""Hang stacks without py-spy: ``import flexrun.train`` registers nothing, so the SIGUSR2
faulthandler dump the agent falls back to must be installed on first use (here the
script's first ``report_progress``; tests/integration/scripts/hang_steps.py never calls
``init``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from train_support import REPO

from flexrun.events import read_events

SCRIPT = REPO / "tests" / "integration" / "scripts" / "hang_steps.py"


@pytest.mark.timeout(180)
def test_stacks_of_a_hung_worker_come_from_its_sigusr2_dump_when_py_spy_is_absent(
    tmp_path: Path,
) -> None:
    bin_dir = tmp_path / "bin"  # a PATH without py-spy
    bin_dir.mkdir()
    for tool in ("sh", "env"):
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).symlink_to(found)
    run_dir = tmp_path / "run"
    env = dict(os.environ, PATH=str(bin_dir), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "flexrun", "run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["--max-restarts", "1", "--hang-timeout", "3", "--warm-spares", "0"]
    cmd += ["--run-dir", str(run_dir), str(SCRIPT), "--marker", str(tmp_path / "hung-once")]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=160, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    assert shutil.which("py-spy", path=env["PATH"]) is None
    hangs = [e for e in read_events(run_dir) if e["event"] == "hang_detected"]
    assert len(hangs) == 1 and hangs[0]["rank"] == 1
    text = "".join(p.read_text() for p in (run_dir / "hangs").glob("*.txt"))
    assert "sleep_forever_in_step" in text and "no stacks" not in text, text[:2000]
