"""Chaos, the schedule: which faults, when (pure; the same seed gives the same faults).

Owns the fault kinds and :func:`make_schedule`; applying faults is
:mod:`flexrun.testing.chaos_job`'s, the verdict :mod:`flexrun.testing.invariants`'.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from flexrun.errors import ConfigError

KINDS = (
    "kill_worker",
    "kill_agent",
    "stop_worker",
    "term_agent",
    "add_node",
    "restart_store",
    "slow_rank",
    "corrupt_checkpoint",
    "disk_full",
)
"""Every fault kind the injector knows."""


@dataclass(frozen=True, slots=True)
class Fault:
    """One scheduled fault: when (seconds after the job started), what, and a seed for
    picking its target among those present at that moment."""

    at_s: float
    kind: str
    pick: int
    hold_s: float


def make_schedule(
    seed: int,
    *,
    duration_s: float,
    interval_s: float,
    kinds: tuple[str, ...] = KINDS,
    start_s: float | None = None,
    jitter: float = 0.3,
) -> list[Fault]:
    """The faults of a run: about one every ``interval_s`` (+-``jitter``), kinds drawn uniformly.

    Raises:
        ConfigError: unknown kind or non-positive interval.
    """
    unknown = set(kinds) - set(KINDS)
    if unknown or not kinds:
        raise ConfigError(f"unknown fault kinds {sorted(unknown)}; known: {', '.join(KINDS)}")
    if interval_s <= 0:
        raise ConfigError(f"interval must be > 0, got {interval_s}")
    rng = random.Random(seed)
    t = interval_s if start_s is None else start_s
    out = []
    while t < duration_s:
        kind = kinds[rng.randrange(len(kinds))]
        out.append(
            Fault(round(t, 3), kind, rng.randrange(1 << 30), round(rng.uniform(1.0, 3.0), 3))
        )
        t += interval_s * (1 + rng.uniform(-jitter, jitter))
    return out
