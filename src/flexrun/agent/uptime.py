"""The productive time of this node's workers, for the job's ETTR.

Owns the bookkeeping of productive segments (from a segment's first observed training step
to its end; a segment ended by a failure only up to its newest resumable checkpoint); it
does not observe steps or checkpoints (the runner does) or decide what a failure is (the
policy does).
"""

from __future__ import annotations

from flexrun._clock import Clock


class Uptime:
    """The productive time of this node's workers: the sum of the segments that ended
    without a failure, and of the failed ones up to the newest checkpoint the restart
    resumes from (what came after it is lost to the restart and done again: without a
    checkpoint the workers said they saved, all of it), each counted from its first
    observed training step (time before it, and a segment in which no step was observed at
    all, is never productive: a job hung in ``init_process_group`` has ETTR 0)."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.total_s = 0.0
        self._since: float | None = None
        self._first_step: float | None = None
        self._segments = 0
        # A fault-free run spends these outside productive time too: its start-up (to the
        # first segment's first step) and what follows its last segment (None: not known,
        # or a segment since failed or never stepped, so that time was lost, not overhead).
        self._lead_end: float | None = None
        self._last_end: float | None = None

    def restart(self) -> None:
        """Workers (re)started: close the open segment as productive, open a new one."""
        self.stop(productive=True)
        self._since = self.clock.monotonic()
        self._segments += 1

    def observe(self, first_step: float | None) -> None:
        """The runner saw the segment's first step at ``first_step`` (monotonic)."""
        if self._since is not None and self._first_step is None and first_step is not None:
            self._first_step = max(first_step, self._since)
            if self._segments == 1:
                self._lead_end = self._first_step

    def stop(self, *, productive: bool, kept_until: float | None = None) -> None:
        """Close the open segment: all of it productive, or (a failure) up to
        ``kept_until`` (monotonic; None: none of it)."""
        if self._since is None:
            return
        now = self.clock.monotonic()
        self._last_end = now if productive and self._first_step is not None else None
        if self._first_step is not None:
            end = now if productive else kept_until
            if end is not None:
                self.total_s += max(min(end, now) - self._first_step, 0.0)
        self._since = None
        self._first_step = None

    def overhead_s(self, started: float) -> float:
        """The time since ``started`` (monotonic: the agent's start) that a run without
        disruptions spends outside productive time as well: the start-up before the first
        segment's first step, and the time after the last segment if it ended productive.
        ``wall - productive - overhead`` is what disruptions cost (failures, restarts,
        resizes, live mode's judged losses)."""
        lead = self._lead_end - started if self._lead_end is not None else 0.0
        tail = self.clock.monotonic() - self._last_end if self._last_end is not None else 0.0
        return max(lead, 0.0) + max(tail, 0.0)
