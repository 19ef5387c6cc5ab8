"""The run's event log: one JSON object a line in ``<run_dir>/events.jsonl``.

Owns the on-disk format and line-atomic appends; it does not decide which events exist
(callers do; docs/contributor/architecture.md lists them) nor aggregate them (the report does). Each line is
written with a single ``write(2)`` on an ``O_APPEND`` descriptor, so concurrent writers
(agents and workers of one node) never interleave within a line, and a writer killed
mid-way leaves at worst one partial last line, which :func:`read_events` skips.

A log that cannot be written (a full or failing disk) never stops the run: the line is
dropped and counted, stderr says so once, and the next line that can be written is
preceded by an ``events_dropped`` record with the count (the log resumes by itself).

With ``echo_stderr`` (``--event-log-handler console``, torchrun's console handler) each
record is also written to stderr, the same JSON object on a line of its own (one
``write(2)``, so it never interleaves with worker lines copied to the same stream).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from flexrun._clock import SYSTEM_CLOCK, Clock

EVENTS_FILE = "events.jsonl"


class EventLog:
    """Appends events for one run, tagged with run id, node and current round."""

    def __init__(
        self,
        run_dir: str | os.PathLike[str] | None,
        *,
        run_id: str,
        node: str | None = None,
        clock: Clock = SYSTEM_CLOCK,
        echo_stderr: bool = False,
    ) -> None:
        self._path = Path(run_dir) / EVENTS_FILE if run_dir is not None else None
        self.run_id = run_id
        self.node = node or socket.gethostname()
        self.round: int | None = None
        self._clock = clock
        self._lock = threading.Lock()
        self.dropped = 0
        """Lines lost to write errors since the log was last writable."""
        self.dropped_total = 0
        self.echo_fd: int | None = 2 if echo_stderr else None
        """Where each record is also written (stderr with ``echo_stderr``; None: nowhere)."""
        if self._path is not None:
            self._path.parent.mkdir(parents=True, exist_ok=True)

    @property
    def path(self) -> Path | None:
        return self._path

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        """Append one event and return the record written (also when logging is off)."""
        record: dict[str, Any] = {
            "ts": round(self._clock.wall(), 6),
            "event": event,
            "run_id": self.run_id,
            "node": self.node,
            "round": fields.pop("round", self.round),
        }
        record.update(fields)
        if self._path is None and self.echo_fd is None:
            return record
        line = format_event(record)
        with self._lock:
            self._echo(line)
            if self._path is None:
                return record
            if self.dropped:
                gap = {**record, "event": "events_dropped", "dropped": self.dropped}
                line = format_event(gap) + line
            try:
                self._append(self._path, line)
            except OSError as exc:
                self._drop(exc)
            else:
                self.dropped = 0
        return record

    def _echo(self, line: bytes) -> None:
        if self.echo_fd is None:
            return
        view = memoryview(line)
        try:
            while view:  # (one write(2) unless the line is larger than the pipe takes)
                view = view[os.write(self.echo_fd, view) :]
        except OSError:
            # The console went away (a closed or broken stderr: nowhere left to say so);
            # stop echoing, the file log goes on.
            self.echo_fd = None

    @staticmethod
    def _append(path: Path, line: bytes) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)

    def _drop(self, exc: OSError) -> None:
        if self.dropped_total == 0:
            print(
                f"flexrun: cannot write the event log {self._path} ({exc.strerror or exc}); "
                "dropping events until it can be written again (training goes on)",
                file=sys.stderr,
            )
        self.dropped += 1
        self.dropped_total += 1


def format_event(record: dict[str, Any]) -> bytes:
    """One event as its log line: compact JSON (anything not JSON as ``str``), a newline."""
    return (json.dumps(record, default=str, separators=(",", ":")) + "\n").encode()


def read_events(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Yield the complete events of a file (or of ``events.jsonl`` in a directory).

    A truncated last line (a writer killed mid-write) is skipped, not an error, and so is
    a line that is not a JSON object (hostile or corrupted: not UTF-8, nested too deep).
    """
    p = Path(path)
    if p.is_dir():
        p = p / EVENTS_FILE
    if not p.exists():
        return
    with p.open("rb") as fh:
        for raw in fh:
            if not raw.endswith(b"\n"):
                continue
            try:
                event = json.loads(raw)
            except (ValueError, RecursionError):  # not JSON, not UTF-8, nested too deep
                continue
            if isinstance(event, dict):
                yield event
