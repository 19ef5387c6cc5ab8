"""Process mechanics, below everything that starts processes (agent, spares, pipeline).

Owns spawning (own session, death with the parent via an exec shim, never
``preexec_fn``), groups of workers (exit times, stopping, reaping), per-rank log files
and their console tee, stack capture, and failure diagnosis (:mod:`.diagnose`, pure). It
knows nothing of rounds, stores or recovery modes.
"""

from flexrun.proc.group import ExitClock, WorkerGroup, read_cause
from flexrun.proc.logs import Tee, log_tail, start_tees
from flexrun.proc.spawn import (
    Process,
    Worker,
    WorkerResult,
    build_command,
    kill_session,
    reap,
    spawn,
    spawn_worker,
    stopped,
)

__all__ = [
    "ExitClock",
    "Process",
    "Tee",
    "Worker",
    "WorkerGroup",
    "WorkerResult",
    "build_command",
    "kill_session",
    "log_tail",
    "read_cause",
    "reap",
    "spawn",
    "spawn_worker",
    "start_tees",
    "stopped",
]
