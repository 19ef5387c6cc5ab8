"""The training time a live job's disruptions cost, judged by a worker from its own commits.

Owns the estimate behind live mode's reported ETTR. The agent counts a live job productive
from its first step to its end, so a failure's cost does not show there: the survivors'
pause before the next committed step, the step in flight done again, and slower steps after
it (fewer workers for the same global batch, a replacement booting beside them, spares
refilling). A disruption (any change of epoch after this worker's first commit) opens a
window; each interval between two commits inside it costs what exceeds the steady step
time, the median of the last :data:`STEADY` intervals outside windows; the window closes
once the median of the last :data:`SETTLED` intervals is back within :data:`TOLERANCE` of
it, or after :data:`MAX_WINDOW` commits (a job that stays smaller then has a new steady
pace). Intervals outside windows (noise, a slow batch) never count. The total is job-wide:
each epoch's members start from the largest total any of them reports, so a replacement
carries the survivors' count on. It does not see time before this worker's first commit,
nor decide what a failure is.
"""

from __future__ import annotations

from collections import deque
from statistics import median

STEADY = 32
"""Intervals outside windows whose median is the steady step time."""
SETTLED = 4
"""A window closes when the median of this many last intervals is back to the steady pace."""
TOLERANCE = 1.1
"""... within this factor of it."""
MAX_WINDOW = 256
"""A window closes after this many commits whatever the pace."""
MIN_STEADY = 4
"""Steady intervals needed before a window is judged (none: its time is not counted)."""


class LostTime:
    """Seconds of training a job's disruptions cost, as one worker's commits show them."""

    def __init__(self) -> None:
        self.lost_s = 0.0
        self._steady: deque[float] = deque(maxlen=STEADY)
        self._recent: deque[float] = deque(maxlen=SETTLED)
        self._last: float | None = None
        self._left = 0  # commits left in the open window (0: no window open)

    def adopt(self, lost_s: float) -> None:
        """The job-wide total as the members of a new epoch reported it."""
        self.lost_s = max(self.lost_s, lost_s)

    def disrupted(self) -> None:
        """The epoch changed: the commits after this one are judged against the pace."""
        if self._last is not None:
            self._left = MAX_WINDOW
            self._recent.clear()

    def committed(self, now: float) -> bool:
        """A step was committed at ``now`` (monotonic); True when the total grew."""
        last, self._last = self._last, now
        if last is None:
            return False
        dt = now - last
        if not self._left:
            self._steady.append(dt)
            return False
        self._left -= 1
        self._recent.append(dt)
        if len(self._steady) < MIN_STEADY:
            return False
        pace = median(self._steady)
        extra = max(dt - pace, 0.0)
        self.lost_s += extra
        if len(self._recent) == SETTLED and median(self._recent) <= pace * TOLERANCE:
            self._left = 0
        return extra > 0


__all__ = ["LostTime"]
