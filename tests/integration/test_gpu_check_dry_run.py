"""bench/gpu_check.py's CPU dry run: every part runs end to end and reports ok, and the JSON
has the structure the GPU run's results are read from (issue 39)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "gpu_check.py"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_gpu_check_dry_run_on_cpu_runs_every_part_and_writes_json_and_summary(
    tmp_path: Path,
) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    env.pop("OUT", None)
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--nproc", "2"]
    cmd += ["--restart-worlds", "2", "--ckpt-params", "2e5", "--out", str(tmp_path / "out")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=840)
    result = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    parts = result["parts"]
    failed = {k: v.get("error") or v for k, v in parts.items() if not v.get("ok")}
    assert proc.returncode == 0 and not failed, (failed, proc.stdout[-3000:], proc.stderr[-3000:])
    assert list(parts) == ["restart", "live", "checkpoint", "observe"] and result["ok"] is True
    env_ = result["environment"]
    assert env_["device_arg"] == "cpu" and env_["torch"] and "date" in env_

    trials = {t["name"]: t for t in parts["restart"]["trials"]}
    assert set(trials) == {"flexrun gloo x2", "torchrun gloo x2"}
    for t in trials.values():
        assert t["recovery_s"] > 0 and t["exit_code"] == 0 and t["left_alive"] == 0
        assert set(t["phase_s"]) == {
            "start_or_handoff",
            "import_torch",
            "device_context",
            "group_init",
            "first_step",
        }
        assert t["cuda_initialized_before_script"] is False and t["bad_fork"] is False
    # flexrun's replacement came from a warm spare (started before the kill, torch imported)
    assert trials["flexrun gloo x2"]["warm_process"] is True
    assert trials["torchrun gloo x2"]["warm_process"] is False

    live = parts["live"]
    assert live["survivors_kept_pids"] is True and live["bitwise_identical"] is True
    assert live["recovery_s"] > 0 and live["killed"]["devices"] == ["cpu"]

    ck = parts["checkpoint"]["methods"]
    assert len(ck) == 3 and all(m["stall_s"] >= 0 and m["durable_s"] > 0 for m in ck.values())

    obs = parts["observe"]
    assert obs["doctor"]["exit_code"] == 0 and obs["doctor"]["devices_matmul_s"]["cpu"] > 0
    assert obs["metrics_node_cpus"] and obs["metrics_gpu"] == {}

    text = (tmp_path / "out" / "gpu_check.txt").read_text()
    assert all(f"## {p}: ok" in text for p in parts)


def test_gpu_check_refuses_bad_options_with_one_line_and_exit_2(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    for bad in (["--parts", "restart,nope"], ["--nproc", "0"], ["--restart-worlds", "x"]):
        proc = subprocess.run(
            [sys.executable, str(SCRIPT), "--device", "cpu", "--out", str(tmp_path), *bad],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 2, (bad, proc.stderr)
        assert "error:" in proc.stderr.strip().splitlines()[-1]
        assert not (tmp_path / "gpu_check.json").exists()
