"""AdoptedProcess: a process the agent did not start, seen through a pidfd and exit records."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from flexrun.spares.adopted import AdoptedProcess
from flexrun.spares.protocol import RECORD_WAIT_S, exit_record


def _adopt(tmp_path: Path, code: str) -> tuple[subprocess.Popen[bytes], AdoptedProcess]:
    (tmp_path / "exits").mkdir(exist_ok=True)
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE)
    assert child.stdin is not None
    return child, AdoptedProcess(child.pid, "s1", child.stdin, tmp_path)


@pytest.mark.timeout(30)
def test_the_parents_record_wins_and_is_consumed(tmp_path: Path) -> None:
    child, adopted = _adopt(tmp_path, "import sys; sys.stdin.read(); sys.exit(3)")
    assert adopted.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        adopted.wait(timeout=0.1)
    assert adopted.stdin is not None
    adopted.stdin.close()
    rc = child.wait(timeout=20)  # the "daemon" reaps and records
    exit_record(tmp_path, "s1").write_text(json.dumps({"returncode": rc}))
    exit_record(tmp_path, "s1", own=True).write_text(json.dumps({"returncode": 0}))
    assert adopted.wait(timeout=10) == 3
    assert not list((tmp_path / "exits").iterdir())


@pytest.mark.timeout(30)
def test_the_spares_own_record_serves_when_the_parent_wrote_none(tmp_path: Path) -> None:
    child, adopted = _adopt(tmp_path, "pass")
    child.wait(timeout=20)
    exit_record(tmp_path, "s1", own=True).write_text(json.dumps({"returncode": 5}))
    assert adopted.wait(timeout=10) == 5


@pytest.mark.timeout(30)
def test_no_record_at_all_reads_as_killed_after_the_grace(tmp_path: Path) -> None:
    child, adopted = _adopt(tmp_path, "import time; time.sleep(60)")
    os.kill(child.pid, signal.SIGKILL)
    child.wait(timeout=20)
    assert adopted.poll() is None  # gone, but the record may still be on its way
    assert adopted.wait(timeout=RECORD_WAIT_S + 5) == -signal.SIGKILL
