"""Bad ``flexrun run`` input through the real CLI: one clear line on stderr, exit 2, at once.

Covers issue 18 point 9's ``run`` inputs (``--monitor-interval nan``, ``--rdzv-conf
heartbeat_interval=nan``, ``--stop-grace inf``, ``--run-dir``/``--log-dir`` naming a file),
torchrun options whose value cannot be honoured here, and a torchrun-valid command line that
flexrun must accept (checked by the parse, not by running it).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from flexrun.cli import main

SRC = Path(__file__).resolve().parents[2] / "src"


def _one_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip() and not ln.startswith("[flexrun]")]
    assert len(lines) == 1 and lines[0].startswith("flexrun: error: "), stderr
    assert "Traceback" not in stderr
    return lines[0]


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('never runs')\n")
    (tmp_path / "afile").write_text("x")
    return tmp_path


BAD = [
    (["--monitor-interval", "nan"], "--monitor-interval nan: must be a finite number"),
    (["--monitor-interval", "inf"], "--monitor-interval"),
    (["--rdzv-conf", "heartbeat_interval=nan"], "heartbeat_interval="),
    (["--rdzv-conf", "heartbeat_timeout=inf"], "heartbeat_timeout="),
    (["--rdzv-conf", "join_timeout=-5"], "join_timeout="),
    (["--stop-grace", "inf"], "--stop-grace 'inf': must be a finite number"),
    (["--shutdown-timeout", "1.5"], "--shutdown-timeout"),  # torchrun's type is int
    (["--run-dir", "afile"], "names a file"),
    (["--log-dir", "afile"], "names a file"),
    (["--log-dir", "afile/sub"], "a file; give a directory"),
    (["--nnodes", "2", "--node-rank", "5"], "--node-rank 5"),
    (["--numa-binding", "node"], "--numa-binding node"),
    (["--numa-binding", "bogus"], "invalid choice"),
    (["--start-method", "thread"], "invalid choice"),
    (["--event-log-handler", "nope"], "--event-log-handler"),
    (["--logs-specs", "missing"], "torchrun.logs_specs:missing"),
    (["-m", "--no-python"], "cannot be used together"),
    (["--rdzv-endpoint", "10.0.0.1:0", "--rdzv-backend", "c10d"], "port 0"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("argv", "needle"), BAD)
def test_bad_run_input_is_one_line_and_exit_2(
    workdir: Path, capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    assert main(["run", *argv, "train.py"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert needle in line, line


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "argv",
    [
        ["--monitor-interval", "nan"],
        ["--rdzv-conf", "heartbeat_interval=nan"],
        ["--stop-grace", "inf"],
        ["--run-dir", "afile"],
        ["--log-dir", "afile"],
    ],
)
def test_issue_18_inputs_in_a_real_process(workdir: Path, argv: list[str]) -> None:
    env = dict(os.environ, PYTHONPATH=str(SRC))
    res = subprocess.run(
        [sys.executable, "-m", "flexrun", "run", *argv, "train.py"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=workdir,
    )
    assert res.returncode == 2, res.stderr
    _one_line(res.stderr)
    assert not (workdir / "flexrun-runs").exists()


@pytest.mark.timeout(60)
def test_bad_pet_value_is_one_line(
    workdir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PET_MAX_RESTARTS", "many")
    assert main(["run", "train.py"]) == 2
    assert "max" in _one_line(capsys.readouterr().err).lower()
