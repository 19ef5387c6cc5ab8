"""Step progress for the agent's hang detection, and stacks on demand.

Owns the worker's side of ``flexrun run --hang-timeout``: :func:`report_progress` touches
the file the agent names in ``FLEXRUN_PROGRESS_FILE`` (at most a few times a second), and
:func:`install_stack_dump` registers :mod:`faulthandler` on SIGUSR2 so that the agent can
ask a silent worker for the Python stacks of all its threads (written to
``FLEXRUN_STACK_FILE``) before it treats the worker as failed. Importing ``flexrun.train``
does neither: the dump is installed on first use, by :func:`flexrun.train.init`, the first
:func:`report_progress` (what the agent's hang detection watches), and the constructors of
``Checkpointer``, ``ShardedCheckpointer``, ``MetricsLogger`` and ``PreemptionGuard``.
Under torchrun, or without ``--hang-timeout``, both are no-ops.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import time
from typing import IO

_MIN_INTERVAL_S = 0.2
_last = 0.0
_stack_fh: IO[str] | None = None


def report_progress(step: int | None = None) -> None:
    """Tell the agent this rank made progress (call once per training step)."""
    global _last
    if _stack_fh is None:
        install_stack_dump()
    path = os.environ.get("FLEXRUN_PROGRESS_FILE")
    now = time.monotonic()
    if not path or now - _last < _MIN_INTERVAL_S:
        return
    _last = now
    try:
        with open(path, "w") as fh:
            fh.write(str(step if step is not None else ""))
    except OSError:
        return  # the run directory is gone: the agent is not watching any more


def install_stack_dump() -> bool:
    """Dump all threads' stacks to ``FLEXRUN_STACK_FILE`` on SIGUSR2. Idempotent."""
    global _stack_fh
    path = os.environ.get("FLEXRUN_STACK_FILE")
    if not path or _stack_fh is not None or not hasattr(signal, "SIGUSR2"):
        return _stack_fh is not None
    try:
        _stack_fh = open(path, "a")  # noqa: SIM115  (kept open for the signal handler)
    except OSError:
        return False
    faulthandler.register(signal.SIGUSR2, file=_stack_fh, all_threads=True, chain=False)
    return True
