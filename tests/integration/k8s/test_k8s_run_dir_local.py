"""The rendered ``PET_RUN_DIR`` of ``spec.runDir``, taken by real ``flexrun run`` agents as three
"pods" would (the volume is a local directory): each pod's events, per-rank logs, stack
dumps and its failure are on the volume once the pod is gone, and ``flexrun report`` builds
one report from all pods' event logs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flexrun.k8s.render import render
from flexrun.k8s.spec import parse_job_spec

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "tests" / "integration" / "scripts" / "ddp_steps.py"
HANG_SCRIPT = REPO / "tests" / "integration" / "scripts" / "plain_steps.py"
EXAMPLE = REPO / "examples" / "k8s" / "job.yaml"


def _flexrun(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flexrun", *args],
        capture_output=True, text=True, timeout=240, env=env, cwd=cwd,
    )  # fmt: skip


@pytest.mark.timeout(600)
def test_pods_write_run_dirs_on_the_volume_and_one_report_reads_them_all(tmp_path: Path) -> None:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["runDir"] = {"existingClaim": "runs", "mountPath": "/runs"}
    job = next(d for d in render(parse_job_spec(doc)) if d["kind"] == "PyTorchJob")
    c = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    rendered = next(e["value"] for e in c["env"] if e["name"] == "PET_RUN_DIR")
    volume = tmp_path / "pvc"  # what the claim holds, outside every pod
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC"))}
    base["PYTHONPATH"] = str(REPO / "src")
    dirs = []
    for pod, extra in (("resnet50-worker-0", []), ("resnet50-worker-1", ["--fail-rank", "1"])):
        run_dir = rendered.replace("$(POD_NAME)", pod).replace("/runs", str(volume), 1)
        work = tmp_path / pod  # the pod's own filesystem, gone with it
        work.mkdir()
        res = _flexrun(
            "run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "0",
            str(SCRIPT), "--steps", "3", "--step-time", "0.01", *extra,
            env=dict(base, PET_RUN_DIR=run_dir), cwd=work,
        )  # fmt: skip
        assert res.returncode == (1 if extra else 0), res.stderr[-2000:]
        assert not (work / "flexrun-runs").exists(), "the run directory was left in the pod"
        dirs.append(Path(run_dir))
    for d in dirs:
        assert d.parent == volume / "resnet50"
        assert (d / "events.jsonl").stat().st_size > 0
        assert sorted(p.name for p in (d / "logs" / "round_1").iterdir()) == ["rank_0", "rank_1"]
        assert (d / "logs" / "round_1" / "rank_0" / "stderr.log").exists()
    failed = (dirs[1] / "logs" / "round_1" / "rank_1" / "stderr.log").read_text()
    assert "deliberate failure on rank 1" in failed
    # A third pod hangs once (rank 1 sleeps forever in step 10): the hang's stack dump is
    # on the volume too, beside that pod's events.
    pod = "resnet50-worker-2"
    run_dir = rendered.replace("$(POD_NAME)", pod).replace("/runs", str(volume), 1)
    work = tmp_path / pod
    work.mkdir()
    res = _flexrun(
        "run", "--standalone", "--nproc-per-node", "2",
        "--max-restarts", "1", "--hang-timeout", "3", str(HANG_SCRIPT),
        "--hang-at", "10", "--marker", str(work / "hung-once"),
        env=dict(base, PET_RUN_DIR=run_dir), cwd=work,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    assert not (work / "flexrun-runs").exists(), "the run directory was left in the pod"
    events = [json.loads(line) for line in Path(run_dir, "events.jsonl").read_text().splitlines()]
    (hang,) = [e for e in events if e["event"] == "hang_detected"]
    stacks = Path(hang["stacks_file"])
    assert stacks.is_relative_to(Path(run_dir)), (stacks, run_dir)
    assert "sleep_forever_in_step" in stacks.read_text()
    dirs.append(Path(run_dir))
    res = _flexrun(
        "report", *map(str, dirs), "-o", str(tmp_path / "report"), env=base, cwd=tmp_path
    )
    assert res.returncode == 0, res.stderr
    page = (tmp_path / "report" / "report.html").read_text()
    assert "worker_failure" in page and "deliberate failure on rank 1" in page
