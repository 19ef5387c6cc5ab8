"""proc.stopped: a process stopped by a signal, seen in /proc (real processes and signals)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from flexrun.proc import stopped


def _until(pred, timeout_s: float = 5.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return False


@pytest.mark.timeout(30)
def test_a_sigstopped_process_is_stopped_until_it_continues() -> None:
    # (a command name with a parenthesis and a space: the state is read after the last ')')
    code = "import setproctitle, time; setproctitle.setthreadtitle('a) T b'); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        assert _until(lambda: stopped(proc.pid) is None and proc.poll() is None)
        proc.send_signal(signal.SIGSTOP)
        assert _until(lambda: stopped(proc.pid) is not None), "SIGSTOP not seen"
        mark = stopped(proc.pid)
        time.sleep(0.2)
        assert stopped(proc.pid) == mark, "a lasting stop changed its mark"
        # A continue and a stop between two looks: stopped again, but it ran in between.
        proc.send_signal(signal.SIGCONT)
        time.sleep(0.05)
        proc.send_signal(signal.SIGSTOP)
        assert _until(lambda: stopped(proc.pid) is not None)
        assert stopped(proc.pid) != mark, "a stop-continue-stop looked like one long stop"
        proc.send_signal(signal.SIGCONT)
        assert _until(lambda: stopped(proc.pid) is None), "SIGCONT not seen"
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert stopped(proc.pid) is None  # (gone: not stopped)


def test_a_pid_that_does_not_exist_is_not_stopped() -> None:
    assert stopped(4_000_000) is None
