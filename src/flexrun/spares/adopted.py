"""A process the agent took but did not start: a spare of the node's ``flexrun spares``.

Owns :class:`AdoptedProcess`, what the agent uses of ``subprocess.Popen`` (the
:class:`~flexrun.proc.Process` protocol) for a process that stays another's child: its exit
is seen through a pidfd, its status comes from the exit records that its parent (the
daemon) or the spare itself wrote (:func:`flexrun.spares.protocol.exit_record`).
"""

from __future__ import annotations

import logging
import os
import select
import signal
import subprocess
from pathlib import Path
from typing import IO

from flexrun._clock import SYSTEM_CLOCK, Clock
from flexrun.spares.protocol import RECORD_WAIT_S, exit_record, read_returncode

log = logging.getLogger("flexrun.spares")

RECORD_SETTLE_S = 0.05
"""How long :meth:`AdoptedProcess.poll` looks for the exit record of a process it has just
seen gone, before leaving it to the next poll."""


def pidfd(pid: int) -> int | None:
    """A pidfd of ``pid``; None when it is gone already."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return None


def process_gone(fd: int | None) -> bool:
    """True once the process behind pidfd ``fd`` (None: already gone) has exited."""
    if fd is None:
        return True
    return bool(select.select([fd], [], [], 0)[0])


class AdoptedProcess:
    """A handed-out spare as the agent sees it (``pid``, ``stdin``, ``returncode``,
    ``poll``, ``wait``)."""

    def __init__(
        self,
        pid: int,
        name: str,
        stdin: IO[bytes] | None,
        root: Path,
        *,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.pid = pid
        self.name = name
        self.stdin: IO[bytes] | None = stdin
        self.returncode: int | None = None
        self.root = root
        self._clock = clock
        self._fd = pidfd(pid)
        self._gone_at: float | None = None

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        if not process_gone(self._fd):
            return None
        rc = self._read_record()
        if rc is None and self._gone_at is None:
            # Its parent records the status as it reaps, a moment after the pidfd said
            # gone: looking again for a few ms spares the caller a monitor interval.
            settle = self._clock.monotonic() + RECORD_SETTLE_S
            while rc is None and self._clock.monotonic() < settle:
                self._clock.sleep(0.002)
                rc = self._read_record()
        if rc is None:
            now = self._clock.monotonic()
            self._gone_at = self._gone_at if self._gone_at is not None else now
            if now - self._gone_at < RECORD_WAIT_S:
                return None
            log.warning(
                "worker pid %d ended and no exit status was recorded (is `flexrun spares` "
                "gone?): reported as killed",
                self.pid,
            )
            rc = -signal.SIGKILL
        self.returncode = rc
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        return rc

    def _read_record(self) -> int | None:
        """The parent's record first (it saw the real end, signals included), else the
        spare's own; both are consumed."""
        paths = (exit_record(self.root, self.name), exit_record(self.root, self.name, own=True))
        for path in paths:
            rc = read_returncode(path)
            if rc is not None:
                for p in paths:
                    p.unlink(missing_ok=True)
                return rc
        return None

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else self._clock.monotonic() + timeout
        while True:
            rc = self.poll()
            if rc is not None:
                return rc
            left = 0.05 if deadline is None else deadline - self._clock.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            if self._fd is not None and self._gone_at is None:
                select.select([self._fd], [], [], min(0.05, left))
            else:
                self._clock.sleep(min(0.01, left))
