"""The productive time of this node's workers, for the job's ETTR.

Owns the bookkeeping of productive segments (from a segment's first observed training step
to its end, counted only when it ended without a failure); it does not observe steps (the
runner does) or decide what a failure is (the policy does).
"""

from __future__ import annotations

from flexrun._clock import Clock


class Uptime:
    """The productive time of this node's workers: the sum of the segments that ended
    without a failure (a failed segment's work is lost to the restart), each counted from
    its first observed training step (time before it, and a segment in which no step was
    observed at all, is never productive: a job hung in ``init_process_group`` has
    ETTR 0)."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.total_s = 0.0
        self._since: float | None = None
        self._first_step: float | None = None

    def restart(self) -> None:
        """Workers (re)started: close the open segment as productive, open a new one."""
        self.stop(productive=True)
        self._since = self.clock.monotonic()

    def observe(self, first_step: float | None) -> None:
        """The runner saw the segment's first step at ``first_step`` (monotonic)."""
        if self._since is not None and self._first_step is None and first_step is not None:
            self._first_step = max(first_step, self._since)

    def stop(self, *, productive: bool) -> None:
        if self._since is not None and productive and self._first_step is not None:
            self.total_s += max(self.clock.monotonic() - self._first_step, 0.0)
        self._since = None
        self._first_step = None
