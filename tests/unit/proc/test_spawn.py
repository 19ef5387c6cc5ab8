"""Spawning: a session of its own, death with the parent (even on kill -9), without
``preexec_fn``; reaping; log offsets. Real, tiny processes (no torch)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from flexrun.proc.spawn import build_command, reap, spawn, spawn_worker


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.timeout(30)
def test_a_spawned_process_runs_the_command_itself_in_its_own_session(tmp_path) -> None:
    proc = spawn(
        [sys.executable, "-c", "import os,sys; print(os.getsid(0), os.getpid())"],
        dict(os.environ),
        stdout=subprocess.PIPE,
    )
    out, _ = proc.communicate(timeout=20)
    sid, pid = (int(x) for x in out.split())
    assert pid == proc.pid and sid == proc.pid  # the shim exec'd: same pid, new session


@pytest.mark.timeout(60)
def test_a_spawned_process_dies_with_its_parent_even_on_kill_9(tmp_path) -> None:
    # A parent process (with a thread running, as the agent has) spawns a child and
    # reports its pid; kill -9 of the parent must take the child down.
    pidfile = tmp_path / "child.pid"
    parent_code = f"""
import sys, threading, time
sys.path.insert(0, {str(os.path.dirname(os.path.dirname(__import__("flexrun").__file__)))!r})
from flexrun.proc.spawn import spawn
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
p = spawn([sys.executable, "-c", "import time; time.sleep(60)"], {{}})
open({str(pidfile)!r}, "w").write(str(p.pid))
time.sleep(60)
"""
    parent = subprocess.Popen([sys.executable, "-c", parent_code])
    try:
        deadline = time.monotonic() + 20
        while not pidfile.exists() or not pidfile.read_text():
            assert time.monotonic() < deadline, "the parent did not start its child"
            time.sleep(0.05)
        child = int(pidfile.read_text())
        assert _alive(child)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        assert _wait_gone(child), "the child outlived its parent's kill -9"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


@pytest.mark.timeout(30)
def test_a_missing_executable_exits_127_with_one_line(tmp_path) -> None:
    proc = spawn(["/nonexistent/flexrun-test"], {}, stderr=subprocess.PIPE)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 127 and b"cannot start" in err


@pytest.mark.timeout(30)
def test_a_worker_records_where_this_attempt_starts_in_a_reused_log(tmp_path) -> None:
    (tmp_path / "stderr.log").write_text("ValueError: OLD ERROR from yesterday\n")
    w = spawn_worker(
        [sys.executable, "-c", "pass"],
        dict(os.environ),
        tmp_path,
        rank=0,
        local_rank=0,
    )
    reap(w)
    assert w.log_offsets["stderr"] == len("ValueError: OLD ERROR from yesterday\n")
    assert w.log_offsets["stdout"] == 0 and not w.files


def test_build_command_forms() -> None:
    assert build_command("t.py", ["a"], module=False, no_python=False)[1:] == ["-u", "t.py", "a"]
    assert build_command("m", [], module=True, no_python=False)[1:] == ["-u", "-m", "m"]
    assert build_command("/bin/x", ["y"], module=False, no_python=True) == ["/bin/x", "y"]
    assert build_command("t.py", [], module=False, no_python=False, python="/py")[0] == "/py"
