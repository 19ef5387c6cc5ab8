"""Graceful preemption with a real SIGTERM, and the example under real torchrun."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from train_support import EXAMPLE, REPO, Launcher, read_jsonl, wait_until


def _last_step(log: Path) -> int:
    steps = [r["step"] for r in read_jsonl(log) if "step" in r]
    return steps[-1] if steps else 0


@pytest.mark.timeout(280)
def test_sigterm_to_one_rank_stops_all_at_a_step_boundary_with_final_checkpoint_and_143(
    launcher: Launcher, tmp_path: Path
) -> None:
    run_dir, ck, log = tmp_path / "run", tmp_path / "ck", tmp_path / "samples"
    args = ["--steps", "100000", "--ckpt-every", "100000", "--step-sleep", "0.02"]
    args += ["--ckpt-dir", str(ck), "--run-dir", str(run_dir), "--sample-log", str(log)]
    g = launcher.start(2, args)
    try:
        wait_until(lambda: _last_step(Path(f"{log}.rank1")) >= 10, 120, "10 steps")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{g.output()}") from None
    g.procs[1].send_signal(signal.SIGTERM)  # only one rank is told; all must agree
    assert g.wait(120) == [143, 143], g.output()

    events = read_jsonl(run_dir / "events.jsonl")
    (pre,) = [e for e in events if e["event"] == "preempted"]
    saved = [e for e in events if e["event"] == "checkpoint_saved"]
    assert [e["step"] for e in saved] == [pre["step"]] and pre["exit_code"] == 143
    last = {r: _last_step(Path(f"{log}.rank{r}")) for r in (0, 1)}
    assert last[0] == last[1] == pre["step"]  # the same step boundary on both ranks
    assert (ck / f"step_{pre['step']}" / "manifest.json").exists()

    again = launcher.start(
        1, ["--steps", str(pre["step"] + 3), "--ckpt-dir", str(ck), "--run-dir", str(run_dir)]
    )
    assert again.wait(120) == [0], again.output()
    assert f"start_step={pre['step']}" in again.logs[0].read_text()


@pytest.mark.timeout(280)
def test_example_runs_and_resumes_under_torchrun(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [str(EXAMPLE), "--steps", "20", "--ckpt-every", "10", "--ckpt-dir", str(ck)]
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=130, cwd=REPO, env=env)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    assert "done at step 20" in first.stdout
    more = [c if c != "20" else "30" for c in cmd]
    second = subprocess.run(more, capture_output=True, text=True, timeout=130, cwd=REPO, env=env)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
    assert re.search(r"start_step=20\b", second.stdout) and "done at step 30" in second.stdout
    manifest = json.loads((ck / "step_30" / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["step"] == 30


@pytest.mark.timeout(280)
def test_flexrun_env_sends_events_to_the_run_dir_and_an_older_round_is_fenced(
    launcher: Launcher, tmp_path: Path
) -> None:
    run_dir, ck = tmp_path / "run", tmp_path / "ck"
    env = {
        "FLEXRUN_RUN_DIR": str(run_dir),
        "FLEXRUN_ROUND": "3",
        "FLEXRUN_RUN_ID": "job7",
        "FLEXRUN_NODE": "n1",
    }
    args = ["--steps", "10", "--ckpt-every", "5", "--ckpt-dir", str(ck)]
    g = launcher.start(1, args, env=env)
    assert g.wait(120) == [0], g.output()
    saved = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "checkpoint_saved"]
    assert [e["step"] for e in saved] == [5, 10]
    for e in saved:
        assert (e["run_id"], e["node"], e["round"]) == ("job7", "n1", 3)
        assert e["bytes"] > 0 and e["stall_s"] >= 0 and e["persist_s"] >= 0
    fence = json.loads((ck / "fence.json").read_text())
    assert (fence["round"], fence["generation"], fence["run"]) == (3, 3, "job7")

    straggler = launcher.start(1, [*args, "--steps", "20"], env={**env, "FLEXRUN_ROUND": "2"})
    assert straggler.wait(120) == [1]
    assert "FencedError" in straggler.output() and "round 3" in straggler.output()
    assert sorted(p.name for p in ck.iterdir() if p.name.startswith("step_")) == [
        "step_10",
        "step_5",
    ]
