"""What the agent learns of its workers' progress: steps seen, hang limits, the first step.

Owns the agent's reading of the progress files that :mod:`flexrun.worker_hook` keeps
(one per worker, rewritten in place: ``"<steps> <beats>"``, mtime = last sign of life)
and applies the calibrated hang rule (its calibration, :class:`HangLimits`, is
:mod:`flexrun.recovery`'s): a rank is hung when it has shown no sign of life for

- before its first step: ``HangLimits.first_step_s`` (init_process_group, the first
  collective, compilation and data warm-up all fit in it);
- after it: ``max(factor x its mean step time, 2 x its longest silence seen)``, at least
  ``floor_s`` (``--hang-timeout``) and at most ``cap_s``.

It reads files and compares times; it kills nothing (the runner does). Time is the
caller's: ``now`` is wall time for file ages, ``mono`` the agent's monotonic clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from flexrun import worker_hook
from flexrun.recovery import HangLimits

MAX_SIGHTINGS = 4096  # step counts remembered per rank between two checkpoints


@dataclass(slots=True)
class RankProgress:
    """What one worker has shown so far (of the current round)."""

    path: Path
    steps: int = 0
    beats: int = 0
    last_seen: float | None = None
    """mtime of the last sign of life (wall)."""
    first_step_mono: float | None = None
    """When the agent first saw a completed step (its monotonic clock)."""
    step_time_s: float | None = None
    """Mean seconds per step (exponentially weighted)."""
    longest_gap_s: float = 0.0
    ended: bool = False
    """The worker said its training is over (teardown is not judged)."""
    counted: bool = True
    """Its steps can be read (False: the hook never could write them, a full disk; its
    mtime still says it is alive)."""
    saved: int = -1
    """The step count of the newest checkpoint it can be resumed from (-1: none said)."""
    seen: list[tuple[int, float]] = field(default_factory=list)
    """(steps, when the agent first saw that many), since the newest checkpoint."""
    _step_seen_at: float | None = None
    _forgot: int = -1  # (sightings up to this step count were dropped: MAX_SIGHTINGS)

    @property
    def hooked(self) -> bool:
        """The worker's hook is installed (so it answers SIGUSR2 with its stacks)."""
        return self.last_seen is not None

    def update(self, mono: float) -> None:
        got = worker_hook.read_saved(self.path)
        if got is None:
            return
        steps, beats, mtime, saved = got
        self.counted = steps >= 0
        self.ended = beats < 0
        if self.last_seen is not None and self.steps > 0 and mtime > self.last_seen:
            # (silences after the first step: start-up, imports and init are not steps)
            self.longest_gap_s = max(self.longest_gap_s, mtime - self.last_seen)
        if steps > self.steps:
            if self._step_seen_at is not None and self.steps > 0:
                per = (mtime - self._step_seen_at) / (steps - self.steps)
                self.step_time_s = (
                    per if self.step_time_s is None else 0.8 * self.step_time_s + 0.2 * per
                )
            if self.first_step_mono is None:
                self.first_step_mono = mono
            self._step_seen_at = mtime
            self.steps = steps
            self.seen.append((steps, mono))
        if saved > self.saved:
            self.saved = saved
            # (keep the first sighting at or past the checkpoint: the time it was taken)
            i = next((k for k, (n, _) in enumerate(self.seen) if n >= saved), len(self.seen))
            del self.seen[:i]
        if len(self.seen) > MAX_SIGHTINGS:
            self._forgot = self.seen[-MAX_SIGHTINGS - 1][0]
            del self.seen[:-MAX_SIGHTINGS]
        self.beats = beats
        self.last_seen = max(mtime, self.last_seen or mtime)

    def saved_mono(self) -> float | None:
        """When (the agent's monotonic clock) this worker's state was what its newest
        resumable checkpoint holds; None: no checkpoint said, or its time is not known."""
        if self.saved <= self._forgot or not self.seen or self.seen[0][0] < self.saved:
            return None
        return self.seen[0][1]

    def limit_s(self, limits: HangLimits) -> float:
        """Seconds of silence after which this rank is hung."""
        if self.steps == 0:
            return limits.first_step_s
        learned = max(limits.factor * (self.step_time_s or 0.0), 2.0 * self.longest_gap_s)
        return min(max(learned, limits.floor_s), limits.cap_s)

    def silent_s(self, now: float) -> float | None:
        return None if self.last_seen is None else max(now - self.last_seen, 0.0)


class ProgressBook:
    """The progress of this node's workers in the current round."""

    def __init__(self) -> None:
        self.ranks: dict[int, RankProgress] = {}

    def reset(self, paths: dict[int, Path]) -> None:
        self.ranks = {r: RankProgress(p) for r, p in paths.items()}

    def update(self, mono: float) -> None:
        for rp in self.ranks.values():
            rp.update(mono)

    def observable(self) -> bool:
        """Some worker's hook is installed (steps can be seen at all)."""
        return any(rp.hooked for rp in self.ranks.values())

    def made_progress(self) -> bool | None:
        """A step was completed this round (None: nothing can tell, no hook installed)."""
        if any(rp.steps > 0 for rp in self.ranks.values()):
            return True
        return False if any(rp.hooked and rp.counted for rp in self.ranks.values()) else None

    def first_step_mono(self) -> float | None:
        seen = [rp.first_step_mono for rp in self.ranks.values() if rp.first_step_mono is not None]
        return min(seen) if seen else None

    def kept_until(self) -> float | None:
        """The time up to which the round's work survives its failure: where the newest
        checkpoint every saving rank has said it can resume from was taken (None: none)."""
        times = [rp.saved_mono() for rp in self.ranks.values() if rp.saved >= 0]
        return None if not times or None in times else min(t for t in times if t is not None)

    def quiet(self, now: float, alive: set[int]) -> dict[int, float]:
        """Ranks (alive, hooked, not ended) -> seconds since their last sign of life."""
        out = {}
        for r, rp in self.ranks.items():
            s = rp.silent_s(now)
            if r in alive and not rp.ended and s is not None:
                out[r] = s
        return out

    def silent(self, now: float, limits: HangLimits, alive: set[int]) -> dict[int, float]:
        """Ranks (alive, hooked) silent past their limit -> seconds silent."""
        return {
            r: s for r, s in self.quiet(now, alive).items() if s > self.ranks[r].limit_s(limits)
        }
