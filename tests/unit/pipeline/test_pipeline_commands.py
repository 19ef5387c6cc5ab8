"""`flexrun pipeline ...` on the command line: bad specs are one line and exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from flexrun.cli import main

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples" / "pipeline" / "pipeline.yaml"

pytestmark = pytest.mark.timeout(120)

CYCLIC = """
name: cyclic
stages:
  - {name: a, command: "true", deps: [c]}
  - {name: b, command: "true", deps: [a]}
  - {name: c, command: "true", deps: [b]}
"""


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        (CYCLIC, "dependency cycle: "),
        ("name: m\nstages:\n  - {name: a, command: x, deps: [ghost]}\n", "unknown stage 'ghost'"),
        ("name: m\nstages: [{name: a, command: x, timeout: soon}]\n", "stages.a.timeout"),
        ("name: m\nstages: [{name: a, command: x, inputs: [nowhere.bin]}]\n", "does not exist"),
        ("{{{", "not valid YAML"),
    ],
)
def test_bad_spec_is_one_line_on_stderr_and_exit_2(tmp_path: Path, text: str, needle: str) -> None:
    spec = tmp_path / "pipeline.yaml"
    spec.write_text(text)
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "flexrun",
            "pipeline",
            "run",
            str(spec),
            "--run-dir",
            str(tmp_path / "r"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("flexrun: error: ") and needle in lines[0]
    assert "Traceback" not in res.stderr


def test_render_prints_a_workflow(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["pipeline", "render", str(EXAMPLE), "--target", "argo"]) == 0
    out = capsys.readouterr().out
    assert "kind: Workflow" in out and "kind: PyTorchJob" in out


def test_render_of_a_cyclic_spec_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = tmp_path / "p.yaml"
    spec.write_text(CYCLIC)
    assert main(["pipeline", "render", str(spec)]) == 2
    assert "dependency cycle" in capsys.readouterr().err


def test_status_of_a_directory_without_state_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["pipeline", "status", str(tmp_path)]) == 2
    assert "no pipeline-state.json" in capsys.readouterr().err


def test_rollback_of_a_missing_registry_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["pipeline", "rollback", str(tmp_path / "models")]) == 2
    assert "no such model directory" in capsys.readouterr().err
