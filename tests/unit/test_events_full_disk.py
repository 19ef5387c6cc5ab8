"""The event log on a full disk: lines are dropped and counted, never an exception."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from flexrun.events import EventLog, read_events


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_disk_drops_events_says_so_once_and_resumes(tmp_path: Path, capsys) -> None:
    log = EventLog(tmp_path, run_id="j", node="n")
    log.emit("first")
    path = tmp_path / "events.jsonl"
    kept = path.read_bytes()
    path.unlink()
    path.symlink_to("/dev/full")  # every write: ENOSPC
    for i in range(3):
        assert log.emit("lost", i=i)["event"] == "lost"  # (no exception)
    assert log.dropped == 3
    err = capsys.readouterr().err
    assert err.count("cannot write the event log") == 1 and "training goes on" in err
    path.unlink()
    path.write_bytes(kept)  # space is back
    log.emit("after")
    names = [e["event"] for e in read_events(tmp_path)]
    assert names == ["first", "events_dropped", "after"]
    assert next(e for e in read_events(tmp_path) if e["event"] == "events_dropped")["dropped"] == 3
    assert log.dropped == 0 and log.dropped_total == 3
