"""Failure diagnosis: from how a worker ended and what it left behind, its root cause.

Pure functions over text and numbers (no files, no processes, no clock): the caller reads
the worker's error file (torch's ``@record`` format) and the tail of its stderr, this
module turns them into a :class:`~flexrun.cause.FailureCause`, tells a failure of a
worker's own from the echo of a peer's death, and reads stack dumps.
"""

from __future__ import annotations

import json
import re

from flexrun.cause import FailureCause
from flexrun.exitcodes import PREEMPTED
from flexrun.proc.spawn import WorkerResult

_EXC_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit|Warning)\b.*)$")
_RANK_PREFIX = re.compile(r"^(\[[^\]\s]*\]:\s?)+")

# What a worker's error says when it failed only because a peer went away.
_CONSEQUENCES = (
    "connection closed by peer",
    "connection reset by peer",
    "remote worker crashing",
    "broken pipe",
    "socket closed",
    "connection refused",
)


def parse_error_file(text: str) -> tuple[str, str] | None:
    """(message, traceback) from an error file's text, or None when it is not one.

    Both torch's ``@record`` shape (``{"message": {"message": ..., "extraInfo":
    {"py_callstack": ...}}}``) and the flat ``{"message": "..."}`` are understood.
    """
    try:
        data = json.loads(text)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    msg = data.get("message")
    if isinstance(msg, dict):
        extra = msg.get("extraInfo")
        tb = extra.get("py_callstack", "") if isinstance(extra, dict) else ""
        return str(msg.get("message", "")), str(tb)
    if isinstance(msg, str):
        return msg, ""
    return None


def last_exception_line(text: str) -> str:
    """The last line of ``text`` that looks like ``SomeError: ...`` (prefixes removed)."""
    for line in reversed(text.splitlines()):
        line = _RANK_PREFIX.sub("", line.strip())
        if _EXC_LINE.match(line):
            return line
    return ""


def cause_of(
    result: WorkerResult,
    *,
    error_file: str | None,
    stderr_tail: str,
    note: str = "",
    log_dir: str = "",
) -> FailureCause:
    """Root cause of one worker's failure: the agent's own ``note`` (it ended the worker,
    e.g. a hang), else the error file, else the last exception line of stderr, else the
    exit code or signal."""
    base = FailureCause(
        rank=result.rank,
        local_rank=result.local_rank,
        pid=result.pid,
        exit_code=result.exit_code,
        signal=result.signal_name,
        log_dir=log_dir,
    )
    if note:
        return base.replace(message=note, traceback=stderr_tail, kind="hang")
    parsed = parse_error_file(error_file) if error_file is not None else None
    if parsed is not None:
        return base.replace(message=parsed[0], traceback=parsed[1])
    message = last_exception_line(stderr_tail) or (
        f"killed by {result.signal_name}"
        if result.signal_name
        else f"exited with code {result.exit_code}"
    )
    return base.replace(message=message, traceback=stderr_tail)


def is_consequence(cause: FailureCause) -> bool:
    """True if the worker failed because a peer went away (not a failure of its own)."""
    if cause.exit_code == PREEMPTED and not cause.signal:
        # The worker stopped by itself with the preemption code while its own agent was
        # not signalled (that agent would not be looking): the ranks agreed to stop
        # because a peer's node is being preempted. That peer leaves the rendezvous next.
        return True
    text = f"{cause.message}\n{cause.traceback[-2000:]}".lower()
    return any(c in text for c in _CONSEQUENCES)


def in_collective(stack: str) -> bool:
    """Whether a Python stack dump shows the thread waiting in a collective."""
    return any(
        m in stack for m in ("distributed_c10d", "all_reduce", "barrier", "broadcast", "all_gather")
    )
