"""The launcher's own TORCHELASTIC_ERROR_FILE record (flexrun.agent.error_file)."""

from __future__ import annotations

import json
from pathlib import Path

from flexrun.agent.error_file import torch_error_record, write_launcher_error_file
from flexrun.cause import FailureCause
from flexrun.proc.diagnose import parse_error_file


def test_the_record_is_torchs_format_with_the_exit_code() -> None:
    cause = FailureCause(rank=1, exit_code=3, message="ValueError: boom", traceback="Traceback")
    rec = torch_error_record(cause, timestamp=1700000000.5)
    assert rec == {
        "message": {
            "message": "ValueError: boom",
            "extraInfo": {"py_callstack": "Traceback", "timestamp": "1700000000"},
            "errorCode": 3,
        }
    }


def test_a_cause_without_a_message_says_how_the_worker_ended() -> None:
    cause = FailureCause(rank=0, exit_code=137, signal="SIGKILL")
    assert torch_error_record(cause, timestamp=0)["message"]["message"] == "killed by SIGKILL"


def test_the_file_is_replaced_and_reads_back(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "err.json"
    path.parent.mkdir()
    path.write_text("old")
    cause = FailureCause(rank=0, message="RuntimeError: x", traceback="tb")
    assert write_launcher_error_file(path, cause, timestamp=1.0)
    assert parse_error_file(path.read_text()) == ("RuntimeError: x", "tb")
    assert [p.name for p in path.parent.iterdir()] == ["err.json"]
    json.loads(path.read_text())


def test_an_unwritable_path_is_a_warning_not_a_crash(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    cause = FailureCause(rank=0, message="m")
    assert not write_launcher_error_file(blocker / "err.json", cause, timestamp=1.0)
