"""Bad files through the real CLI (issue 18, point 9): one clear line, exit 2, no traceback.

``python -m flexrun pipeline run`` given a binary or non-UTF-8 spec, and ``pipeline run`` /
``pipeline status`` on a run directory whose state file is binary, not UTF-8 or not a JSON
object. Nothing runs (no stage starts) when the input is bad.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.timeout(120)


def _flexrun(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PET_")}
    return subprocess.run(
        [sys.executable, "-m", "flexrun", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=cwd,
    )


def _assert_one_clear_line(proc: subprocess.CompletedProcess[str], path: Path, why: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("flexrun: error:") and str(path) in lines[0], lines[0]
    assert why in lines[0], lines[0]


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (bytes(range(256)) * 4, "a binary file"),
        ("name: caf\xe9\nstages: []\n".encode("latin-1"), "not UTF-8 text"),
        (b"- not\n- a mapping\n", "must be a mapping"),
    ],
    ids=["binary", "non_utf8", "not_a_mapping"],
)
def test_pipeline_run_of_a_bad_spec_is_one_clear_line(
    tmp_path: Path, content: bytes, why: str
) -> None:
    f = tmp_path / "pipeline.yaml"
    f.write_bytes(content)
    proc = _flexrun("pipeline", "run", str(f), "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
    _assert_one_clear_line(proc, f, why)
    assert not (tmp_path / "run").exists()


STATE = {
    "binary": (b"\x00\x01\x02\x03\xff", "a binary file"),
    "non_utf8": (b'{"version": 1, "stages": {"a": "\xff"}}', "not UTF-8 text"),
    "not_an_object": (b"[1, 2, 3]", "a JSON list, not an object"),
    "stages_not_objects": (b'{"version": 1, "stages": {"echo": 7}}', "'stages' must map"),
}


@pytest.mark.parametrize("case", sorted(STATE))
def test_a_bad_state_file_is_one_clear_line_for_run_and_status(tmp_path: Path, case: str) -> None:
    content, why = STATE[case]
    spec = tmp_path / "pipeline.yaml"
    marker = tmp_path / "ran"
    spec.write_text(
        yaml.safe_dump(
            {
                "name": "p",
                "stages": [{"name": "echo", "command": ["touch", str(marker)]}],
            }
        )
    )
    run = tmp_path / "run"
    run.mkdir()
    state = run / "pipeline-state.json"
    state.write_bytes(content)
    proc = _flexrun("pipeline", "run", str(spec), "--run-dir", str(run), cwd=tmp_path)
    _assert_one_clear_line(proc, state, why)
    assert not marker.exists(), "a stage ran despite the unreadable state"
    assert state.read_bytes() == content  # left as it was, for the user to look at
    proc = _flexrun("pipeline", "status", str(run), cwd=tmp_path)
    _assert_one_clear_line(proc, state, why)
