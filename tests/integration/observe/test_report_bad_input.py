"""Hostile event logs and bad files given to ``python -m flexrun report`` (issue 18, point 9).

A file that holds no usable event (binary, not UTF-8, not JSON) is one clear line and exit
2; a log with some malformed lines (``ts: "abc"``, ``round: "zz"``, a non-UTF-8 line,
wrong-typed fields) is reported from its good lines, and the page and the command say how
many were skipped. Never a traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

SRC = Path(__file__).resolve().parents[3] / "src"

GOOD = [
    {"ts": 100.0, "event": "rendezvous_started", "round": 0, "run_id": "j", "node": "a"},
    {
        "ts": 101.0,
        "event": "rendezvous_completed",
        "round": 0,
        "run_id": "j",
        "node": "a",
        "world_size": 2,
        "members": ["a"],
    },
    {"ts": 105.0, "event": "job_finished", "round": 0, "run_id": "j", "node": "a", "exit_code": 0},
]

HOSTILE_LINES = {
    "ts_abc": b'{"ts": "abc", "event": "failure", "round": 0, "node": "a"}\n',
    "round_zz": b'{"ts": 102.0, "event": "failure", "round": "zz", "node": "a"}\n',
    "non_utf8": b'{"ts": 102.0, "event": "failure\xff", "round": 0}\n',
    "nested": b"[" * 100000 + b"\n",
    "not_object": b"[1, 2, 3]\n",
    "ts_nan": b'{"ts": NaN, "event": "failure", "round": 0}\n',
    "round_bool": b'{"ts": 102.0, "event": "failure", "round": true}\n',
    "bad_resources": b'{"ts": 102.0, "event": "resources", "round": 0, "gpus": [1]}\n',
}


def _flexrun(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PET_")}
    env["PYTHONPATH"] = str(SRC)
    return subprocess.run(
        [sys.executable, "-m", "flexrun", *args],
        capture_output=True,
        text=True,
        timeout=90,
        env=env,
        cwd=cwd,
    )


def _good_lines() -> bytes:
    return b"".join(json.dumps(e).encode() + b"\n" for e in GOOD)


@pytest.mark.parametrize(
    "content",
    [bytes(range(256)) * 8, "ts: caf\xe9\n".encode("latin-1"), "x".encode("utf-16") + b"\n"],
    ids=["binary", "non_utf8", "utf16"],
)
def test_report_of_a_file_with_no_event_is_one_clear_line(tmp_path: Path, content: bytes) -> None:
    f = tmp_path / "events.jsonl"
    f.write_bytes(content)
    res = _flexrun("report", str(f), "-o", str(tmp_path / "out"), cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("flexrun: error: "), res.stderr
    assert str(f) in lines[0] and "no usable event" in lines[0], lines[0]
    assert not (tmp_path / "out" / "report.html").exists()


def test_report_skips_and_counts_every_hostile_line(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    good = _good_lines().splitlines(keepends=True)
    (run / "events.jsonl").write_bytes(
        good[0] + good[1] + b"".join(HOSTILE_LINES.values()) + good[2]
    )
    res = _flexrun("report", str(run), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    assert f"({len(HOSTILE_LINES)} malformed event line(s) skipped)" in res.stdout, res.stdout
    page = (run / "report.html").read_text()
    assert f"{len(HOSTILE_LINES)} malformed event line(s) skipped" in page
    assert "No incidents" in page  # the hostile "failure" lines were not counted as one


@pytest.mark.parametrize("case", ["ts_abc", "round_zz"])
def test_the_two_issue_18_lines_alone_beside_good_events(tmp_path: Path, case: str) -> None:
    (tmp_path / "events.jsonl").write_bytes(_good_lines() + HOSTILE_LINES[case])
    res = _flexrun("report", str(tmp_path), cwd=tmp_path)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    assert "(1 malformed event line(s) skipped)" in res.stdout, res.stdout


def test_store_on_an_unresolvable_host_fails_fast_in_one_line(tmp_path: Path) -> None:
    import time

    t0 = time.monotonic()
    res = _flexrun("store", "--host", "999.1.1.1", "--port", "0", cwd=tmp_path)
    took = time.monotonic() - t0
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "999.1.1.1" in lines[0] and "Traceback" not in res.stderr
    assert took < 30, took  # was 38 s and 22 lines (issue 18); a bound, not a speed claim
