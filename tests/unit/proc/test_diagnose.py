"""Failure diagnosis: error files, stderr tails, echoes of a peer's death (pure)."""

from __future__ import annotations

import json

from flexrun.cause import FailureCause
from flexrun.proc.diagnose import (
    cause_of,
    in_collective,
    is_consequence,
    last_exception_line,
    parse_error_file,
)
from flexrun.proc.spawn import WorkerResult

RECORD = json.dumps(
    {
        "message": {
            "message": "ValueError: bad batch",
            "extraInfo": {"py_callstack": "Traceback...\nValueError: bad batch", "timestamp": "1"},
        }
    }
)


def result(rc: int) -> WorkerResult:
    return WorkerResult(local_rank=1, rank=5, pid=42, returncode=rc, ended_at=1.0)


def test_torch_record_error_files_give_message_and_traceback() -> None:
    assert parse_error_file(RECORD) == (
        "ValueError: bad batch",
        "Traceback...\nValueError: bad batch",
    )
    assert parse_error_file('{"message": "flat"}') == ("flat", "")


def test_anything_else_is_not_an_error_file() -> None:
    for text in ("", "not json", "[1, 2]", '{"message": 3}', '{"message": {"extraInfo": 7}}'):
        parsed = parse_error_file(text)
        assert parsed is None or parsed == ("", "")


def test_the_error_file_wins_over_stderr() -> None:
    c = cause_of(result(1), error_file=RECORD, stderr_tail="RuntimeError: noise\n", log_dir="/l")
    assert c.message == "ValueError: bad batch" and c.rank == 5 and c.log_dir == "/l"
    assert c.exit_code == 1 and c.signal is None and c.kind == "exit"


def test_without_an_error_file_the_last_exception_line_of_stderr_is_the_message() -> None:
    tail = "[rank5]:Traceback (most recent call last):\n[rank5]:KeyError: 'x'\nbye\n"
    c = cause_of(result(1), error_file=None, stderr_tail=tail)
    assert c.message == "KeyError: 'x'" and c.traceback == tail


def test_a_killed_worker_says_which_signal() -> None:
    c = cause_of(result(-9), error_file=None, stderr_tail="")
    assert c.signal == "SIGKILL" and c.exit_code == 137 and c.message == "killed by SIGKILL"
    assert cause_of(result(3), error_file=None, stderr_tail="").message == "exited with code 3"


def test_the_agents_note_wins_and_marks_a_hang() -> None:
    c = cause_of(result(-9), error_file=RECORD, stderr_tail="t", note="hang: no progress for 9s")
    assert c.kind == "hang" and c.message.startswith("hang:") and c.traceback == "t"


def test_echoes_of_a_peers_death_are_consequences() -> None:
    assert is_consequence(FailureCause(message="RuntimeError: Connection reset by peer"))
    assert is_consequence(FailureCause(traceback="...\ngloo: Connection closed by peer [x]"))
    assert is_consequence(FailureCause(exit_code=143, message="exited with code 143"))
    assert not is_consequence(FailureCause(exit_code=143, signal="SIGTERM"))
    assert not is_consequence(FailureCause(message="ValueError: mine"))


def test_exception_lines_are_found_behind_any_log_prefix() -> None:
    assert last_exception_line("[default0]:ZeroDivisionError: division by zero") == (
        "ZeroDivisionError: division by zero"
    )
    assert last_exception_line("no error here\n") == ""


def test_a_stack_in_a_collective_is_recognised() -> None:
    assert in_collective('File "torch/distributed/distributed_c10d.py", line 1, in all_reduce')
    assert not in_collective('File "train.py", line 3, in <module>\n  time.sleep(10)')
