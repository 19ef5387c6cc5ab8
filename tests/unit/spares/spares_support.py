"""Helpers for the warm-interpreter unit tests: fake spares (the real hand-over code, no
torch) and a daemon served in a thread."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import wait_for

from flexrun.spares.client import query_status
from flexrun.spares.daemon import SparesDaemon
from flexrun.spares.pool import WarmPool
from flexrun.testing import FakeClock

FAKE_SPARE = [
    sys.executable,
    "-c",
    "import sys; from flexrun.spares.become import serve_assignment; sys.exit(serve_assignment())",
]

# A warm agent without torch or the CLI: what it runs after the hand-over prints what it
# received to the client's own stdout and exits with the code named by argv[0].
FAKE_AGENT = [
    sys.executable,
    "-c",
    """
import json, os, sys
from flexrun.spares.become import await_handover
from flexrun.spares.lifeline import run_recorded
from flexrun.spares.protocol import AGENT_SOCKET_ENV, EXIT_RECORD_ENV, READY_ENV
record = os.environ.get(EXIT_RECORD_ENV)
req = await_handover(os.environ[AGENT_SOCKET_ENV], os.environ.get(READY_ENV))
if req is None:
    sys.exit(0)
def run():
    out = {"argv": list(req.argv), "cwd": os.getcwd(), "marker": os.environ.get("MARKER")}
    print(json.dumps(out), flush=True)
    return int(req.argv[0])
sys.exit(run_recorded(run, record))
""",
]


class Served:
    """A :class:`SparesDaemon` of fake spares, served by a thread of the test process."""

    def __init__(self, root: Path, count: int = 2, agents: int = 0) -> None:
        self.root = root
        self.clock = FakeClock()
        self.daemon = SparesDaemon(
            root,
            count,
            environ=os.environ,
            refill_delay_s=0,
            agents=agents,
            commands={"worker": FAKE_SPARE, "agent": FAKE_AGENT},
            clock=self.clock,
        )
        self._stop = threading.Event()
        self.thread = threading.Thread(
            target=self.daemon.serve, args=(self._stop.is_set, 0.01), daemon=True
        )
        self.thread.start()

    def wait_ready(self, ready: int, agents: int = 0) -> dict:
        """The daemon's status once ``ready`` spares and ``agents`` agents are ready."""

        def status() -> dict | None:
            s = query_status(self.root)
            return s if s["ready"] >= ready and s["agents_ready"] >= agents else None

        return dict(wait_for(status, 20, "the daemon's spares to be ready", interval=0.01))  # type: ignore[call-overload]

    def close(self) -> None:
        given = list(self.daemon.given)  # (the daemon keeps these alive for their taker)
        self._stop.set()
        self.thread.join(timeout=20)
        assert not self.thread.is_alive()
        for s in given:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(s.proc.pid, signal.SIGKILL)
            s.proc.wait(timeout=10)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    s = Served(tmp_path / "spares")
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def pools() -> Iterator[list[WarmPool]]:
    """Warm pools a test makes, closed after it."""
    made: list[WarmPool] = []
    yield made
    for p in made:
        p.close()
