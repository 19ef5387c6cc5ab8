"""Why a job stopped or restarted: the root cause, one frozen record from end to end.

Owns :class:`FailureCause` and its JSON form. The agent's failure diagnosis builds one
from a worker's exit (error file, stderr tail, signal), the rendezvous stores it in the
round record (so every node of a failed job reports the same cause), the event log and
``flexrun status`` show it, and the CLI prints it. It knows nothing of processes or stores.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


def _int_or_none(value: object) -> int | None:
    if value is None or value == "":
        return None
    try:
        return int(str(value))
    except ValueError:
        return None


@dataclass(frozen=True, kw_only=True, slots=True)
class FailureCause:
    """What made a worker (or a node) fail."""

    rank: int | None = None
    """Global rank of the failed worker (None: not one worker, e.g. a lost node)."""
    local_rank: int | None = None
    pid: int | None = None
    exit_code: int = 1
    """Shell-style exit code: 128+N for signal N."""
    signal: str | None = None
    """Name of the signal that ended the worker (``SIGKILL``), if one did."""
    message: str = ""
    """One line: the exception, or why the agent ended the worker (a hang)."""
    traceback: str = ""
    log_dir: str = ""
    """Where the worker's stdout/stderr logs are."""
    node: str = ""
    """Id of the node whose worker failed."""
    round: int | None = None
    """The rendezvous round the worker ran in."""
    worker_id: str = ""
    """Live mode: the worker's id (its rank changes between epochs)."""
    kind: str = "exit"
    """``exit`` (the worker ended), ``hang`` (ended by the agent: no progress),
    ``node_lost`` (a whole node vanished)."""

    def replace(self, **changes: Any) -> FailureCause:
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        """``killed by SIGKILL`` or ``exit code 3``."""
        return f"killed by {self.signal}" if self.signal else f"exit code {self.exit_code}"

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (round records, events, error files)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> FailureCause | None:
        """The record written by :meth:`to_dict` (None for an empty or missing one).

        Tolerant of foreign or older records: unknown fields are ignored and malformed
        numbers become None, since a cause read from the store must never crash a reader.
        """
        if not data or not isinstance(data, Mapping):
            return None
        code = _int_or_none(data.get("exit_code"))
        return cls(
            rank=_int_or_none(data.get("rank")),
            local_rank=_int_or_none(data.get("local_rank")),
            pid=_int_or_none(data.get("pid")),
            exit_code=code if code is not None else 1,
            signal=str(data["signal"]) if data.get("signal") else None,
            message=str(data.get("message") or ""),
            traceback=str(data.get("traceback") or ""),
            log_dir=str(data.get("log_dir") or ""),
            node=str(data.get("node") or ""),
            round=_int_or_none(data.get("round")),
            worker_id=str(data.get("worker_id") or ""),
            kind=str(data.get("kind") or "exit"),
        )
