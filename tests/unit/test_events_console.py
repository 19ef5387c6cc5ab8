"""``--event-log-handler console``: the event log's records also on stderr (events.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from flexrun.events import EventLog, format_event, read_events


def _read_all(fd: int) -> bytes:
    out = b""
    while chunk := os.read(fd, 65536):
        out += chunk
    return out


def test_an_event_is_one_compact_json_line() -> None:
    line = format_event({"event": "x", "path": Path("/a"), "n": 1})
    assert line == b'{"event":"x","path":"/a","n":1}\n'


def test_with_echo_each_record_also_goes_to_the_console_as_the_file_gets_it(
    tmp_path: Path,
) -> None:
    log = EventLog(tmp_path, run_id="r", node="n", echo_stderr=True)
    assert log.echo_fd == 2
    read, write = os.pipe()
    log.echo_fd = write
    log.emit("worker_started", rank=0)
    log.emit("job_succeeded")
    os.close(write)
    echoed = [json.loads(ln) for ln in _read_all(read).splitlines()]
    assert [e["event"] for e in echoed] == ["worker_started", "job_succeeded"]
    assert echoed == list(read_events(tmp_path))


def test_without_echo_nothing_extra_is_written_and_a_lost_console_stops_only_the_echo(
    tmp_path: Path,
) -> None:
    assert EventLog(tmp_path, run_id="r").echo_fd is None  # (the default: null handler)
    log = EventLog(tmp_path, run_id="r", echo_stderr=True)
    read, write = os.pipe()
    os.close(read)
    log.echo_fd = write  # (a broken pipe: EPIPE)
    log.emit("a")
    log.emit("b")
    os.close(write)
    assert log.echo_fd is None
    assert [e["event"] for e in read_events(tmp_path)] == ["a", "b"]


def test_echo_works_with_no_file_log(tmp_path: Path) -> None:
    log = EventLog(None, run_id="r", echo_stderr=True)
    read, write = os.pipe()
    log.echo_fd = write
    assert log.emit("a")["event"] == "a"
    os.close(write)
    assert json.loads(_read_all(read))["event"] == "a"
