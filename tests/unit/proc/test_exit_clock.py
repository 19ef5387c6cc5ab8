"""The exit clock: when each worker died, seen through pidfds, and a wake-up per death."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import pytest

from flexrun.proc import ExitClock


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen(["sleep", "60"])


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.timeout(30)
def test_each_death_is_timed_and_wakes_the_caller_also_for_a_process_added_later() -> None:
    fds_before = _open_fds()
    first, later = _sleeper(), _sleeper()
    woken = threading.Semaphore(0)
    clock = ExitClock([first.pid], woken.release)
    clock.start()
    clock.add(later.pid)
    try:
        for proc in (first, later):
            killed_at = time.time()
            proc.send_signal(signal.SIGKILL)
            assert woken.acquire(timeout=10), f"no wake-up for pid {proc.pid}'s death"
            assert clock.times[proc.pid] >= killed_at
            proc.wait()
        assert not woken.acquire(timeout=0.2), "woken with nobody dead"
    finally:
        clock.close()
        for proc in (first, later):
            proc.kill()
            proc.wait()
    assert not clock.is_alive()
    assert _open_fds() == fds_before  # (the pidfds and the wake-up pipe, all closed)


@pytest.mark.timeout(30)
def test_a_process_added_after_close_is_ignored_and_close_twice_is_harmless() -> None:
    proc = _sleeper()
    clock = ExitClock([])
    clock.start()
    clock.close()
    try:
        clock.add(proc.pid)
        clock.close()
        assert clock.times == {}
    finally:
        proc.kill()
        proc.wait()
