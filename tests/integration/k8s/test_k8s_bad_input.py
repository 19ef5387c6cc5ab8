"""Bad files through the real CLI (issue 18, point 9): one clear line, exit 2, no traceback.

``python -m flexrun k8s render|validate`` given a binary file, a non-UTF-8 file, a file
that is YAML but not a spec, or a directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

BAD_FILES = {
    "binary": bytes(range(256)) * 4,
    "non_utf8": "metadata:\n  name: caf\xe9\n".encode("latin-1"),
    "utf16": "kind: PyTorchJob\n".encode("utf-16"),
    "deeply_nested": b"[" * 20000,
    "bad_timestamp": b"apiVersion: v1\nkind: Service\nmetadata: {name: 2020-13-45}\n",
    "not_a_mapping": b"- just\n- a list\n",
}


def _flexrun(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PET_")}
    return subprocess.run(
        [sys.executable, "-m", "flexrun", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def _assert_one_clear_line(proc: subprocess.CompletedProcess[str], path: Path) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    last = lines[-1]
    assert last.startswith("flexrun: error:") and str(path) in last, proc.stderr
    return last


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_k8s_render_of_a_bad_file_is_one_clear_line(tmp_path: Path, case: str) -> None:
    f = tmp_path / f"{case}.yaml"
    f.write_bytes(BAD_FILES[case])
    proc = _flexrun("k8s", "render", str(f))
    last = _assert_one_clear_line(proc, f)
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stdout == ""
    expected = {
        "binary": "a binary file",
        "non_utf8": "not UTF-8 text",
        "utf16": "a binary file",  # UTF-16 text has NUL bytes: not the UTF-8 a spec must be
        "deeply_nested": "not valid YAML",
        "bad_timestamp": "not valid YAML",
        "not_a_mapping": "must be a mapping",
    }[case]
    assert expected in last, last


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_k8s_validate_of_a_bad_file_is_one_clear_line(tmp_path: Path, case: str) -> None:
    f = tmp_path / f"{case}.yaml"
    f.write_bytes(BAD_FILES[case])
    proc = _flexrun("k8s", "validate", "-q", str(f))
    _assert_one_clear_line(proc, f)


def test_k8s_render_and_validate_of_a_directory_are_one_clear_line(tmp_path: Path) -> None:
    for args in (("k8s", "render", str(tmp_path)), ("k8s", "validate", str(tmp_path))):
        proc = _flexrun(*args)
        last = _assert_one_clear_line(proc, tmp_path)
        assert "cannot read" in last
