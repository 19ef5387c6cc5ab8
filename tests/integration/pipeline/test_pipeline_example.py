"""The digits example pipeline end to end, with real processes: `flexrun pipeline run`.

preprocess (sklearn digits -> tensors) -> train (`flexrun run`, 2 workers, flexrun.train
checkpoints) -> evaluate (accuracy JSON, threshold) -> export (safetensors + model card,
v1/v2/... with a `current` pointer). Kept tiny (60 steps) to fit the test budget.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

REPO = Path(__file__).resolve().parents[3]
EXAMPLE_DIR = REPO / "examples" / "pipeline"

pytest.importorskip("sklearn", reason="the example pipeline needs scikit-learn (extra: examples)")
pytest.importorskip("safetensors", reason="the export stage needs safetensors (extra: pipeline)")


def _spec(tmp_path: Path, *, step_sleep: float | None = None, threshold: str = "0.85") -> Path:
    spec: dict[str, Any] = yaml.safe_load((EXAMPLE_DIR / "pipeline.yaml").read_text())
    spec["pipelineDir"] = str(EXAMPLE_DIR)
    stages = {s["name"]: s for s in spec["stages"]}
    if step_sleep is not None:
        stages["train"]["train"]["args"] += ["--step-sleep", str(step_sleep)]
    stages["evaluate"]["command"] = stages["evaluate"]["command"].replace(
        "--threshold 0.85", f"--threshold {threshold}"
    )
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "flexrun", "pipeline", *args]


def _run(spec: Path, run_dir: Path, timeout: float) -> tuple[int, str]:
    res = subprocess.run(
        _cli("run", str(spec), "--run-dir", str(run_dir), "--stop-grace", "10"),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return res.returncode, res.stdout + res.stderr


def _state(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "pipeline-state.json").read_text())


def _executed(state: dict[str, Any]) -> list[str]:
    recs = state["stages"]
    return [n for n in state["order"] if recs[n]["status"] == "succeeded" and not recs[n]["cached"]]


def _start_steps(log: Path) -> list[int]:
    return [int(m) for m in re.findall(r"start_step=(\d+)", log.read_text())]


@pytest.fixture
def reaper() -> Iterator[list[psutil.Process]]:
    procs: list[psutil.Process] = []
    yield procs
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.kill()


@pytest.mark.timeout(240)
def test_example_runs_end_to_end_then_reruns_only_what_changed(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    code, out = _run(_spec(tmp_path), run_dir, timeout=200)
    assert code == 0, out[-4000:]
    state = _state(run_dir)
    assert _executed(state) == ["preprocess", "train", "evaluate", "export"]
    for name in ("preprocess", "train", "evaluate", "export"):
        assert f"[{name}] " in out  # streamed with the stage's prefix
    models = run_dir / "models"
    assert (models / "current").read_text().strip() == "v1"
    card = json.loads((models / "v1" / "model_card.json").read_text())
    assert card["metrics"]["accuracy"] > 0.8  # chance is 0.1
    assert card["torch_version"] and card["flexrun_version"] and len(card["data_sha256"]) == 64
    assert (models / "v1" / "model.safetensors").stat().st_size > 0
    meta = json.loads((run_dir / "data" / "meta.json").read_text())
    assert card["data_sha256"] == meta["data_sha256"]

    status = subprocess.run(
        _cli("status", str(run_dir)), capture_output=True, text=True, timeout=60
    )
    assert status.returncode == 0
    assert re.search(r"train\s+succeeded\s+\d+\.\ds", status.stdout), status.stdout

    # Only evaluate's command changes: evaluate and export run, nothing else.
    code, out = _run(_spec(tmp_path, threshold="0.8"), run_dir, timeout=120)
    assert code == 0, out[-4000:]
    assert _executed(_state(run_dir)) == ["evaluate", "export"]
    assert "[pipeline] preprocess: cached" in out and "[pipeline] train: cached" in out
    assert (models / "current").read_text().strip() == "v2"

    rollback = subprocess.run(
        _cli("rollback", str(models)), capture_output=True, text=True, timeout=60
    )
    assert rollback.returncode == 0, rollback.stderr
    assert (models / "current").read_text().strip() == "v1"
    assert sorted(p.name for p in models.iterdir() if p.name.startswith("v")) == ["v1", "v2"]

    # An accuracy under the threshold fails the pipeline: nothing new is exported.
    code, out = _run(_spec(tmp_path, threshold="0.999"), run_dir, timeout=120)
    assert code == 1, out[-4000:]
    state = _state(run_dir)
    assert state["stages"]["evaluate"]["status"] == "failed"
    assert state["stages"]["export"]["status"] == "blocked"
    assert "below the threshold 0.999" in out
    assert json.loads((run_dir / "metrics.json").read_text())["passed"] is False
    assert (models / "current").read_text().strip() == "v1"


@pytest.mark.timeout(240)
def test_sigkill_during_training_then_rerun_resumes_from_the_checkpoint(
    tmp_path: Path, reaper: list[psutil.Process]
) -> None:
    spec = _spec(tmp_path, step_sleep=0.3)
    run_dir = tmp_path / "run"
    with (tmp_path / "first.log").open("wb") as log:
        runner = subprocess.Popen(
            _cli("run", str(spec), "--run-dir", str(run_dir)),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    root = psutil.Process(runner.pid)
    reaper.append(root)
    latest = run_dir / "ckpt" / "latest"
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline and not latest.exists():
        assert runner.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        time.sleep(0.1)
    assert latest.exists(), "no checkpoint was committed"
    assert _state(run_dir)["stages"]["train"]["status"] == "running"

    # SIGKILL the runner and every process under it (agent, workers), all at once.
    victims = [root, *root.children(recursive=True)]
    reaper.extend(victims)
    for p in victims:
        with contextlib.suppress(psutil.Error):
            p.kill()
    gone, alive = psutil.wait_procs(victims, timeout=20)
    assert not alive, alive
    killed_at = int(latest.read_text().strip().split("_")[-1] or 0) if latest.exists() else 0
    assert not (run_dir / "model").exists(), "training finished before the kill"

    code, out = _run(spec, run_dir, timeout=200)
    assert code == 0, out[-4000:]
    state = _state(run_dir)
    assert state["stages"]["preprocess"]["cached"] is True
    assert "[pipeline] preprocess: cached" in out
    assert _executed(state) == ["train", "evaluate", "export"]
    starts = _start_steps(run_dir / "logs" / "train.log")
    assert starts[0] == 0 and starts[-1] >= 10, starts  # resumed, not from step 0
    assert starts[-1] >= min(killed_at, 10)
    card = json.loads((run_dir / "models" / "v1" / "model_card.json").read_text())
    assert card["metrics"]["accuracy"] > 0.8


@pytest.mark.timeout(120)
def test_sigterm_stops_the_training_stage_and_its_workers(tmp_path: Path) -> None:
    spec = _spec(tmp_path, step_sleep=0.3)
    run_dir = tmp_path / "run"
    with (tmp_path / "out.log").open("wb") as log:
        runner = subprocess.Popen(
            _cli("run", str(spec), "--run-dir", str(run_dir), "--stop-grace", "20"),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        latest = run_dir / "ckpt" / "latest"
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not latest.exists():
            assert runner.poll() is None
            time.sleep(0.1)
        tree = psutil.Process(runner.pid).children(recursive=True)
        assert tree, "no stage processes"
        runner.send_signal(signal.SIGTERM)
        assert runner.wait(timeout=60) == 128 + signal.SIGTERM
        _, alive = psutil.wait_procs(tree, timeout=10)
        assert not alive, alive
        assert _state(run_dir)["stages"]["train"]["status"] == "interrupted"
    finally:
        if runner.poll() is None:
            runner.kill()


@pytest.mark.timeout(60)
def test_export_without_safetensors_fails_with_a_clear_message(tmp_path: Path) -> None:
    code = (
        "import runpy, sys; sys.modules['safetensors'] = None; "
        f"sys.path.insert(0, {str(EXAMPLE_DIR)!r}); sys.argv = ['export.py']; "
        f"runpy.run_path({str(EXAMPLE_DIR / 'export.py')!r}, run_name='__main__')"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=50
    )
    assert res.returncode == 1
    assert "the 'safetensors' package is not installed" in res.stderr
    assert "pip install 'flexrun[pipeline]'" in res.stderr
    assert "Traceback" not in res.stderr
