"""The local runner on small real-process pipelines: order, cache, invalidation, resume, stops."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from flexrun.errors import ConfigError, SpecError
from flexrun.pipeline.runner import Runner, RunOptions
from flexrun.pipeline.spec import load_pipeline

TOY = Path(__file__).resolve().parent / "toy_stage.py"

pytestmark = pytest.mark.timeout(120)


def _cmd(tag: str, *extra: str) -> list[str]:
    return ["{python}", "{pipeline_dir}/toy_stage.py", "--tag", tag, *extra]


def _four_stages(**overrides: list[str]) -> dict[str, Any]:
    """preprocess -> train -> evaluate -> export, like the example, with toy commands."""
    cmds = {
        "preprocess": _cmd("pre1", "--out", "data.txt"),
        "train": _cmd("train1", "--in", "data.txt", "--out", "model.txt"),
        "evaluate": _cmd("eval1", "--in", "model.txt", "--out", "metrics.txt"),
        "export": _cmd("export1", "--in", "model.txt", "--in", "metrics.txt", "--out", "pub.txt"),
    }
    cmds.update(overrides)
    return {
        "name": "toy",
        "pipelineDir": str(TOY.parent),
        "stages": [
            {"name": "preprocess", "command": cmds["preprocess"], "outputs": ["data.txt"]},
            {
                "name": "train",
                "command": cmds["train"],
                "inputs": ["data.txt"],
                "outputs": ["model.txt"],
            },
            {
                "name": "evaluate",
                "command": cmds["evaluate"],
                "inputs": ["model.txt"],
                "outputs": ["metrics.txt"],
            },
            {
                "name": "export",
                "command": cmds["export"],
                "inputs": ["model.txt", "metrics.txt"],
                "outputs": ["pub.txt"],
            },
        ],
    }


def _run(tmp_path: Path, spec: dict[str, Any], **opts: Any) -> tuple[int, str, dict[str, Any]]:
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(spec))
    out = io.StringIO()
    run_dir = tmp_path / "run"
    runner = Runner(
        load_pipeline(path),
        RunOptions(run_dir=run_dir, stop_grace_s=opts.pop("stop_grace_s", 5.0), **opts),
        environ=dict(os.environ),
        out=out,
    )
    code = runner.run()
    state = json.loads((run_dir / "pipeline-state.json").read_text())
    return code, out.getvalue(), state


def _ran(state: dict[str, Any]) -> list[str]:
    """Stages that executed (not cached) in the latest run, in pipeline order."""
    recs = state["stages"]
    return [n for n in state["order"] if recs[n]["status"] == "succeeded" and not recs[n]["cached"]]


def test_runs_in_dependency_order_with_prefixed_logs_and_records_state(tmp_path: Path) -> None:
    code, out, state = _run(tmp_path, _four_stages())
    assert code == 0, out
    calls = [line.split()[0] for line in (tmp_path / "run" / "calls.log").read_text().splitlines()]
    assert calls == ["pre1", "train1", "eval1", "export1"]
    assert "[preprocess] toy pre1 starting" in out
    assert (tmp_path / "run" / "logs" / "train.log").read_text().count("toy train1 starting") == 1
    rec = state["stages"]["train"]
    assert rec["status"] == "succeeded" and rec["exit_code"] == 0 and rec["duration_s"] > 0
    assert set(rec["inputs"]) == {"data.txt"} and rec["inputs"]["data.txt"]
    assert rec["outputs"]["model.txt"] and rec["command"][-1] == "model.txt"
    assert (tmp_path / "run" / "pub.txt").read_text() == "export1train1pre1eval1train1pre1"


def test_rerun_skips_every_unchanged_stage(tmp_path: Path) -> None:
    assert _run(tmp_path, _four_stages())[0] == 0
    code, out, state = _run(tmp_path, _four_stages())
    assert code == 0
    assert _ran(state) == []
    assert out.count("cached (inputs and command unchanged)") == 4


def test_changing_preprocess_command_invalidates_it_and_everything_downstream(
    tmp_path: Path,
) -> None:
    assert _run(tmp_path, _four_stages())[0] == 0
    # Same output bytes as before is not enough to keep downstream: upstream keys chain.
    changed = _cmd("pre1", "--out", "data.txt", "--sleep", "0")
    code, _, state = _run(tmp_path, _four_stages(preprocess=changed))
    assert code == 0
    assert _ran(state) == ["preprocess", "train", "evaluate", "export"]


def test_changing_only_evaluate_reruns_evaluate_and_export_only(tmp_path: Path) -> None:
    assert _run(tmp_path, _four_stages())[0] == 0
    changed = _cmd("eval2", "--in", "model.txt", "--out", "metrics.txt")
    code, _, state = _run(tmp_path, _four_stages(evaluate=changed))
    assert code == 0
    assert _ran(state) == ["evaluate", "export"]
    assert state["stages"]["preprocess"]["cached"] and state["stages"]["train"]["cached"]


def test_a_deleted_output_reruns_its_stage(tmp_path: Path) -> None:
    assert _run(tmp_path, _four_stages())[0] == 0
    (tmp_path / "run" / "metrics.txt").unlink()
    _, _, state = _run(tmp_path, _four_stages())
    # evaluate wrote the same bytes again under the same key: export stays up to date.
    assert _ran(state) == ["evaluate"]


def test_failure_blocks_downstream_and_rerun_resumes_at_the_failed_stage(tmp_path: Path) -> None:
    failing = _cmd("eval1", "--in", "model.txt", "--out", "metrics.txt", "--fail-first")
    code, out, state = _run(tmp_path, _four_stages(evaluate=failing))
    assert code == 1
    assert state["stages"]["evaluate"]["status"] == "failed"
    assert state["stages"]["evaluate"]["message"] == "exit code 3"
    assert state["stages"]["export"]["status"] == "blocked"
    assert state["run_status"] == "failed"
    code, out, state = _run(tmp_path, _four_stages(evaluate=failing))
    assert code == 0, out
    assert _ran(state) == ["evaluate", "export"]


def test_retries_rerun_a_failed_attempt(tmp_path: Path) -> None:
    spec = _four_stages(
        evaluate=_cmd("eval1", "--in", "model.txt", "--out", "metrics.txt", "--fail-first")
    )
    spec["stages"][2]["retries"] = 1
    code, out, state = _run(tmp_path, spec)
    assert code == 0, out
    assert state["stages"]["evaluate"]["attempts"] == 2
    assert "attempt 1 failed: exit code 3" in out


def test_timeout_stops_the_stage_and_fails_it(tmp_path: Path) -> None:
    spec = _four_stages(train=_cmd("train1", "--sleep", "60", "--out", "model.txt"))
    spec["stages"][1]["timeout"] = 1.5
    t0 = time.monotonic()
    code, _, state = _run(tmp_path, spec, stop_grace_s=2.0)
    assert code == 1
    assert time.monotonic() - t0 < 30
    assert state["stages"]["train"]["message"] == "timed out after 1.5s"


def test_missing_declared_output_fails_the_stage(tmp_path: Path) -> None:
    code, _, state = _run(tmp_path, _four_stages(preprocess=_cmd("pre1")))
    assert code == 1
    assert "did not write declared output(s): data.txt" in state["stages"]["preprocess"]["message"]


def test_independent_stages_run_in_parallel(tmp_path: Path) -> None:
    spec = {
        "name": "par",
        "pipelineDir": str(TOY.parent),
        "stages": [
            {
                "name": "a",
                "command": _cmd("a", "--sleep", "1.5", "--out", "a.txt"),
                "outputs": ["a.txt"],
            },
            {
                "name": "b",
                "command": _cmd("b", "--sleep", "1.5", "--out", "b.txt"),
                "outputs": ["b.txt"],
            },
            {
                "name": "c",
                "command": _cmd("c", "--in", "a.txt", "--in", "b.txt"),
                "inputs": ["a.txt", "b.txt"],
            },
        ],
    }
    code, out, _ = _run(tmp_path, spec)
    assert code == 0, out
    rows = {
        line.split()[0]: line.split()
        for line in (tmp_path / "run" / "calls.log").read_text().splitlines()
    }
    a_start, a_end = float(rows["a"][1]), float(rows["a"][2])
    b_start, b_end = float(rows["b"][1]), float(rows["b"][2])
    assert a_start < b_end and b_start < a_end, "a and b did not overlap"
    assert float(rows["c"][1]) >= max(a_end, b_end)


def test_missing_external_input_is_a_spec_error_before_anything_runs(tmp_path: Path) -> None:
    spec = _four_stages()
    spec["stages"][0]["inputs"] = ["raw/never.csv"]
    with pytest.raises(SpecError, match=r"stages\.preprocess\.inputs\[0\]: 'raw/never.csv'"):
        _run(tmp_path, spec)
    assert not (tmp_path / "run" / "calls.log").exists()


def test_stop_request_stops_the_running_stage_process_group(tmp_path: Path) -> None:
    spec = _four_stages(train=_cmd("train1", "--sleep", "60", "--out", "model.txt"))
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(spec))
    runner = Runner(
        load_pipeline(path),
        RunOptions(run_dir=tmp_path / "run", stop_grace_s=3.0),
        environ=dict(os.environ),
        out=io.StringIO(),
    )
    result: dict[str, int] = {}
    t = threading.Thread(target=lambda: result.setdefault("code", runner.run()))
    t.start()
    state_file = tmp_path / "run" / "pipeline-state.json"
    deadline = time.monotonic() + 30
    pid = None
    while time.monotonic() < deadline and pid is None:
        if state_file.exists():
            rec = json.loads(state_file.read_text())["stages"].get("train", {})
            pid = rec.get("pid") if rec.get("status") == "running" else None
        time.sleep(0.05)
    assert pid is not None
    runner.request_stop(signal.SIGTERM)
    t.join(timeout=30)
    assert not t.is_alive()
    assert result["code"] == 128 + signal.SIGTERM
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    state = json.loads(state_file.read_text())
    assert state["stages"]["train"]["status"] == "interrupted"
    assert state["stages"]["evaluate"]["status"] == "blocked"


def test_second_runner_on_the_same_run_dir_is_refused(tmp_path: Path) -> None:
    spec = _four_stages(preprocess=_cmd("pre1", "--sleep", "30", "--out", "data.txt"))
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(spec))
    first = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "flexrun",
            "pipeline",
            "run",
            str(path),
            "--run-dir",
            str(tmp_path / "run"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    state_file = tmp_path / "run" / "pipeline-state.json"

    def stage_pid() -> int | None:
        if not state_file.exists():
            return None
        return json.loads(state_file.read_text())["stages"].get("preprocess", {}).get("pid")

    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and stage_pid() is None:
            time.sleep(0.05)
        pid = stage_pid()
        assert pid is not None
        with pytest.raises(ConfigError, match="another `flexrun pipeline run` is using it"):
            _run(tmp_path, spec)
    finally:
        first.send_signal(signal.SIGINT)
        assert first.wait(timeout=30) == 130
    # Ctrl-C stopped the running stage's whole session, not just the runner.
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_rerun_stops_a_stage_left_running_by_a_sigkilled_runner(tmp_path: Path) -> None:
    spec = _four_stages(train=_cmd("train1", "--sleep-once", "60", "--out", "model.txt"))
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(spec))
    run_dir = tmp_path / "run"
    runner = subprocess.Popen(
        [sys.executable, "-m", "flexrun", "pipeline", "run", str(path), "--run-dir", str(run_dir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    leftover = None
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and leftover is None:
            if (run_dir / "pipeline-state.json").exists():
                rec = json.loads((run_dir / "pipeline-state.json").read_text())["stages"]
                if rec.get("train", {}).get("status") == "running" and rec["train"].get("pid"):
                    leftover = psutil.Process(rec["train"]["pid"])
            time.sleep(0.05)
        assert leftover is not None
        runner.kill()  # the runner only: its stage lives on in its own session
        runner.wait(timeout=10)
        assert leftover.is_running()
        code, out, state = _run(tmp_path, spec)
        assert code == 0, out
        assert f"stopped process {leftover.pid} left by a killed runner" in out
        leftover.wait(timeout=10)
        assert _ran(state) == ["train", "evaluate", "export"]
    finally:
        if runner.poll() is None:
            runner.kill()
        if leftover is not None and leftover.is_running():
            leftover.kill()
