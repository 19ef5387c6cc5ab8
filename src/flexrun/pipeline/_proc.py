"""Stage processes: started in their own session, stopped as a whole tree, never waited on forever.

Owns how a stage process is started (new session, output piped), stopped (SIGTERM to its
process group and every descendant, a bounded grace, then SIGKILL) and how a session left
behind by a killed runner is recognised and stopped. It does not know stages or state.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import psutil


def start(argv: Sequence[str], *, cwd: Path, env: Mapping[str, str]) -> subprocess.Popen[bytes]:
    """Start ``argv`` as the leader of a new session; stdout and stderr merged into a pipe.

    Raises:
        OSError: the executable cannot be started.
    """
    return subprocess.Popen(
        list(argv),
        cwd=cwd,
        env=dict(env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def _signal_all(pid: int, procs: list[psutil.Process], sig: int) -> None:
    # The group catches what children did not re-session; the walk catches those that did.
    with contextlib.suppress(OSError):
        os.killpg(pid, sig)
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.send_signal(sig)


def stop_tree(proc: subprocess.Popen[bytes], grace_s: float, sig: int = signal.SIGTERM) -> int:
    """Send ``sig`` to the process's group and descendants, SIGKILL after ``grace_s``.

    Returns the process's exit status (negative for a signal, as Popen does).
    """
    procs = _tree(proc.pid)
    _signal_all(proc.pid, procs, sig)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if proc.poll() is not None and not any(_alive(p) for p in procs[1:]):
            break
        time.sleep(0.05)
    procs = procs + [p for p in _tree(proc.pid) if p not in procs]
    _signal_all(proc.pid, procs, signal.SIGKILL)
    try:
        return proc.wait(timeout=5)
    except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL not delivered
        return -signal.SIGKILL


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def stop_leftover(pid: int, started: float, grace_s: float) -> bool:
    """Stop a stage session that a killed runner left running; True if there was one.

    Only a process that is still its own session leader and was created within a second
    of ``started`` (epoch seconds) counts: a reused pid is left alone.
    """
    try:
        p = psutil.Process(pid)
        if os.getsid(pid) != pid or abs(p.create_time() - started) > 1.0:
            return False
    except (psutil.Error, OSError):
        return False
    procs = _tree(pid)
    _signal_all(pid, procs, signal.SIGTERM)
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    _signal_all(pid, alive, signal.SIGKILL)
    psutil.wait_procs(alive, timeout=5)
    return True
