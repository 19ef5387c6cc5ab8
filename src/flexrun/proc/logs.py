"""Per-rank log files: copying them to the console, and reading what an attempt wrote.

Owns the console tee (a thread per stream that follows a growing log file and prefixes
each line) and tail reads bounded to one attempt: a run directory that is reused appends
to the same files, so both start at the offset the file had when the attempt began, and
neither replays nor blames what an earlier run wrote.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import IO


class Tee(threading.Thread):
    """Copies a growing log file, from ``offset``, to the console with a line prefix."""

    def __init__(
        self, path: Path, prefix: str, out: IO[str], done: threading.Event, offset: int = 0
    ) -> None:
        super().__init__(name=f"flexrun-tee-{path.name}", daemon=True)
        self.path, self.prefix, self.out, self.done = path, prefix, out, done
        self.offset = offset

    def run(self) -> None:
        with self.path.open("rb") as fh:
            fh.seek(self.offset)
            partial = b""
            while True:
                chunk = fh.read(65536)
                if chunk:
                    partial += chunk
                    *lines, partial = partial.split(b"\n")
                    for line in lines:
                        self.out.write(f"{self.prefix}{line.decode(errors='replace')}\n")
                    self.out.flush()
                    continue
                if self.done.is_set():
                    if partial:
                        self.out.write(f"{self.prefix}{partial.decode(errors='replace')}\n")
                        self.out.flush()
                    return
                time.sleep(0.05)


def start_tees(
    wdir: Path,
    prefix: str,
    console_streams: frozenset[str],
    done: threading.Event,
    offsets: dict[str, int] | None = None,
) -> list[Tee]:
    """Copy a worker's ``stdout.log``/``stderr.log`` (those in ``console_streams``) to the
    console while ``done`` is unset, each from its ``offsets`` entry (default 0)."""
    tees = []
    for stream, console in (("stdout", sys.stdout), ("stderr", sys.stderr)):
        if stream in console_streams:
            offset = (offsets or {}).get(stream, 0)
            tee = Tee(wdir / f"{stream}.log", prefix, console, done, offset)
            tee.start()
            tees.append(tee)
    return tees


def log_tail(path: Path, max_bytes: int = 8192, *, since: int = 0) -> str:
    """The last ``max_bytes`` of a log file written after offset ``since``, as text
    ("" when unreadable)."""
    try:
        with path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(since, size - max_bytes, 0))
            return fh.read().decode(errors="replace")
    except OSError:
        return ""
