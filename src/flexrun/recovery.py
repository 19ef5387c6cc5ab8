"""Recovery rules: when a failure is one more restart, when the job has had enough.

Owns, in one pure module with one :class:`RecoverySettings`, the rules that turn a
worker failure into a verdict: the restart budget (``--max-restarts``: per job in restart
mode, torchrun's rule; per window in live mode, :attr:`RecoverySettings.restart_window_s`),
the crash loop (``--crash-loop-restarts``: so many failed restarts in a row without a
completed step end the job with exit code 86, NO_PROGRESS) and the hang rule's
calibration (:class:`HangLimits`, from ``--hang-timeout``). It performs no I/O and reads
no clock (``now`` is the caller's). The rendezvous writes the verdicts into rounds
(:func:`flexrun.rendezvous.decide.failure_round`, ``counted_failure``); the agent's
runners apply the hang limits (:mod:`flexrun.agent.progress`). A new failure policy is a
setting here, a rule here, and the flag that sets it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flexrun.config import RendezvousSettings


@dataclass(frozen=True, kw_only=True, slots=True)
class RecoverySettings:
    """What the recovery rules need (validated where they are given: the config)."""

    max_restarts: int = 3
    """Failures tolerated per job, or per ``restart_window_s`` when that is set."""
    restart_window_s: float = 0.0
    """0: every failure of the job counts (restart mode). Positive: the failures of the
    current window of this many seconds count (live mode's rule)."""
    crash_loop_restarts: int = 3
    """Failed restarts in a row without a completed step tolerated (then once more ends
    the job with NO_PROGRESS); 0: off."""
    hang_timeout_s: float = 0.0
    """``--hang-timeout``: the hang rule's floor (0: off)."""

    @classmethod
    def of(cls, rdzv: RendezvousSettings, *, hang_timeout_s: float = 0.0) -> RecoverySettings:
        return cls(
            max_restarts=rdzv.max_restarts,
            restart_window_s=rdzv.restart_window_s,
            crash_loop_restarts=rdzv.crash_loop_restarts,
            hang_timeout_s=hang_timeout_s,
        )


# -- verdicts -----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Restart:
    """Within the budget: carry on with these counts."""

    restarts: int
    stalled: int
    window: float
    """When the current restart window opened (wall time; live mode)."""


@dataclass(frozen=True, slots=True)
class Exhausted:
    """The budget is spent: the job fails with the failing worker's code."""

    restarts: int


@dataclass(frozen=True, slots=True)
class CrashLoop:
    """Failed restarts in a row without a completed step: the job fails with 86."""

    restarts: int
    stalled: int


Verdict = Restart | Exhausted | CrashLoop


def stalled_after(stalled: int, progressed: bool | None) -> int:
    """Failures in a row without a completed step, counting this one (``progressed``
    None: nobody could observe steps, which never counts as a stall)."""
    return stalled + 1 if progressed is False else 0


def over_budget(restarts: int, s: RecoverySettings) -> bool:
    return restarts > s.max_restarts


def _crash_loop(s: RecoverySettings, stalled: int) -> bool:
    return s.crash_loop_restarts > 0 and stalled > s.crash_loop_restarts


def restart_failure(
    restarts: int, stalled: int, window: float, progressed: bool | None, s: RecoverySettings
) -> Verdict:
    """Restart mode: one more failure of a round that had ``restarts`` and ``stalled``.
    The crash loop is judged first (its exit code says: do not requeue)."""
    restarts += 1
    stalled = stalled_after(stalled, progressed)
    if _crash_loop(s, stalled):
        return CrashLoop(restarts, stalled)
    if over_budget(restarts, s):
        return Exhausted(restarts)
    return Restart(restarts, stalled, window)


def live_failure(
    restarts: int,
    stalled: int,
    window: float,
    now: float,
    progressed: bool | None,
    s: RecoverySettings,
) -> Verdict:
    """Live mode: one more failure counted against the budget of the current window
    (``now``: wall time; a failure after the window ended opens a new one, whose failures
    are counted afresh)."""
    stalled_now = stalled_after(stalled, progressed)
    if _crash_loop(s, stalled_now):
        return CrashLoop(restarts + 1, stalled_now)
    start, counted = window, restarts + 1
    if s.restart_window_s > 0 and (restarts == 0 or now - start >= s.restart_window_s):
        start, counted = now, 1
    if over_budget(counted, s):
        return Exhausted(counted)
    return Restart(counted, stalled_now, start)


# -- hangs --------------------------------------------------------------------------------------
DEFAULT_FLOOR_S = 60.0
"""``--hang-timeout``'s default: no rank is called hung after less silence than this."""
CAP_S = 1800.0
"""However slow the steps learned, a rank silent this long is hung."""
FACTOR = 10.0
FIRST_STEP_MIN_S = 120.0
FIRST_STEP_FLOORS = 5.0


@dataclass(frozen=True, kw_only=True, slots=True)
class HangLimits:
    """The calibration of the hang rule (stated in every ``hang_detected`` event)."""

    floor_s: float
    cap_s: float
    factor: float = FACTOR
    first_step_s: float

    @classmethod
    def from_timeout(cls, hang_timeout_s: float) -> HangLimits | None:
        """``--hang-timeout``: the floor (0: hang detection off)."""
        if hang_timeout_s <= 0:
            return None
        return cls(
            floor_s=hang_timeout_s,
            cap_s=max(CAP_S, hang_timeout_s),
            first_step_s=max(FIRST_STEP_MIN_S, FIRST_STEP_FLOORS * hang_timeout_s),
        )


def hang_limits(s: RecoverySettings) -> HangLimits | None:
    return HangLimits.from_timeout(s.hang_timeout_s)


__all__ = [
    "CrashLoop",
    "Exhausted",
    "HangLimits",
    "RecoverySettings",
    "Restart",
    "Verdict",
    "hang_limits",
    "live_failure",
    "over_budget",
    "restart_failure",
    "stalled_after",
]
