"""Live mode's agent <-> worker contract: store keys and the membership epoch record.

Owns only these names, so that both sides share one definition without the agent
importing ``flexrun.train`` (which imports torch: an agent that imports torch takes seconds
longer to start, and a joining node's first step waits for it). The protocol itself is
described in ``flexrun.train.live`` (workers) and ``flexrun.agent.live`` (agents).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

STATE_MARK = "state"
"""A live worker writes this to its heartbeat file once it holds live state (has joined
an epoch); the agent reads it to tell whether a job's live state survived."""


@dataclass(frozen=True, slots=True)
class EpochRecord:
    """Who trains in epoch ``number``, in rank order."""

    number: int
    members: tuple[str, ...]
    abort: bool

    def encode(self) -> bytes:
        return json.dumps(
            {"v": 1, "number": self.number, "members": list(self.members), "abort": self.abort}
        ).encode()

    @classmethod
    def decode(cls, raw: bytes) -> EpochRecord:
        d = json.loads(raw)
        return cls(int(d["number"]), tuple(d["members"]), bool(d["abort"]))


def live_keys(run_id: str) -> tuple[str, str]:
    """(epoch key, per-epoch namespace prefix) of a job's live mode."""
    root = f"flexrun/{run_id}/live/"
    return root + "epoch", root + "e/"


def formed_key(run_id: str) -> str:
    """Set once some epoch of the job has formed (someone has held live state)."""
    return f"flexrun/{run_id}/live/formed"


__all__ = ["STATE_MARK", "EpochRecord", "formed_key", "live_keys"]
