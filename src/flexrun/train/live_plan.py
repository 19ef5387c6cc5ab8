"""Live mode's recovery decision: from what each member of a new epoch reports, whose state
everyone takes, and whether live state can be used at all.

Pure code (no store, no process group, no torch): ``flexrun.train.live`` gathers the
members' reports through the store and carries the plan out. A plan with a ``fallback``
reason means live recovery cannot succeed and the members restart from the latest
durable checkpoint, as restart mode would (issue 5, item 5):

- nobody holds state: every worker of the previous epoch died (or, before the first
  epoch formed, the job is starting: that is a resume, not a fallback);
- the members' states disagree: committed steps more than one apart (a member one step
  behind is normal: an all-reduce may complete on some ranks and fail on others), or
  different model checksums at the same step (silent corruption on some rank).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from flexrun.live_protocol import MemberReport


@dataclass(frozen=True, slots=True)
class RecoveryPlan:
    """What the members of an epoch do before they train."""

    source: int
    """Rank whose state every member takes (after loading the durable checkpoint, if asked)."""
    transfer: bool
    """The source broadcasts its state (some member lacks it, or is a step behind)."""
    load_durable: bool
    """The source first restores the newest durable checkpoint."""
    fallback: str | None
    """Why live state cannot be used (None: live recovery, or the job's first start)."""


def plan_recovery(reports: Sequence[MemberReport], *, formed: bool) -> RecoveryPlan:
    """Decide how the members of an epoch (``reports`` in rank order) get their state.

    ``formed``: some epoch of this job has formed before (so someone once held state).
    Every member computes the same plan from the same reports.
    """
    world = len(reports)
    holders = [r for r, m in enumerate(reports) if m.has_state]
    if not holders:
        reason = (
            "no member holds live state: every worker of the previous epoch died"
            if formed
            else None
        )
        return RecoveryPlan(source=0, transfer=world > 1, load_durable=True, fallback=reason)
    best = max(reports[r].step for r in holders)
    reason = None
    behind = sorted({reports[r].step for r in holders if reports[r].step < best - 1})
    sums = {reports[r].checksum for r in holders if reports[r].step == best}
    if behind:
        reason = f"members' committed steps disagree: {behind} vs {best}"
    elif len(sums) > 1:
        reason = f"members at step {best} disagree on the model checksum ({len(sums)} distinct)"
    if reason is not None:
        return RecoveryPlan(source=0, transfer=world > 1, load_durable=True, fallback=reason)
    source = min(r for r in holders if reports[r].step == best)
    lagging = len(holders) < world or any(reports[r].step != best for r in holders)
    return RecoveryPlan(source=source, transfer=lagging, load_durable=False, fallback=None)


__all__ = ["MemberReport", "RecoveryPlan", "plan_recovery"]
