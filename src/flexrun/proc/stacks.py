"""Python stacks of a live process: ``py-spy dump`` when installed, else the faulthandler
dump that ``flexrun.train`` installs on SIGUSR2 (written to the worker's stack file).

Owns only capturing; deciding that a process hangs, and what to do, is the agent's.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from flexrun.proc.spawn import file_size


def capture_stacks(pid: int, stack_file: Path, timeout_s: float = 10.0) -> str:
    """The stacks of process ``pid`` as text (a sentence saying why when none came)."""
    pyspy = shutil.which("py-spy")
    if pyspy is not None:
        try:
            res = subprocess.run(
                [pyspy, "dump", "--pid", str(pid)],
                capture_output=True,
                text=True,
                timeout=timeout_s,
            )
            if res.returncode == 0 and res.stdout.strip():
                return res.stdout
        except (OSError, subprocess.TimeoutExpired):
            pass  # (py-spy cannot attach here, e.g. no ptrace permission): ask the worker
    before = file_size(stack_file)
    try:
        os.kill(pid, signal.SIGUSR2)
    except ProcessLookupError:
        return ""
    deadline = time.monotonic() + min(timeout_s, 3.0)
    while time.monotonic() < deadline:
        time.sleep(0.1)
        if file_size(stack_file) > before:
            time.sleep(0.2)  # let the dump finish
            with stack_file.open() as fh:
                fh.seek(before)
                return fh.read()
    return "(no stacks: py-spy is not installed and the worker did not answer SIGUSR2)"
