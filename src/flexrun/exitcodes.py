"""The launcher's exit codes: the one table (README, "Exit codes").

Owns the numbers a scheduler acts on; which code a run ends with is decided by the agent.
Kubeflow's ``ExitCode`` restart policy (and a pod failure policy) treats 1..127 as
permanent and 128..255 as retryable: the codes below are chosen to fall on the right side.
"""

from __future__ import annotations

import signal

OK = 0
"""Every worker finished."""
BAD_INPUT = 2
"""Flags, spec files, an unreachable endpoint: one clear line on stderr; never retry."""
SIGNAL_BASE = 128
"""128 + N: the job stopped on signal N (retryable)."""
PREEMPTED = SIGNAL_BASE + signal.SIGTERM
"""143: SIGTERM, a preemption (retryable). flexrun.train's workers exit with it after an
agreed stop, too."""
NO_PROGRESS = 86
"""A crash loop: restarts in a row completed no step. Do not requeue (1..127: permanent)."""
NODE_LOST = 200
"""A fixed-size (static) job lost a node: retryable, and above every signal number so it
is never read as one."""

STORE_LOST = 201
"""The store stayed unreachable for longer than the join timeout while no workers ran (it
was reached before: not bad input). Retryable."""


def for_signal(signum: int) -> int:
    """The exit code of a job stopped by ``signum``."""
    return SIGNAL_BASE + int(signum)
