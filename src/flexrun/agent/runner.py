"""The Runner protocol: this node's workers under one recovery mode.

Owns the seam between the agent's loop (rendezvous, policy, signals, outages) and the
two ways of running workers: :class:`flexrun.agent.restart.RestartRunner` (torchrun
semantics: every round starts the workers afresh) and
:class:`flexrun.agent.live.LiveRunner` (workers survive rounds; a dead one is replaced).
The mode is chosen once, when the agent is built; nothing else branches on it. A runner
never steps the rendezvous: the agent's loop hands it each round with its master address
(:data:`MasterSource`), which the loop publishes or awaits.
"""

from __future__ import annotations

import enum
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from flexrun.agent.policy import Event
from flexrun.live_protocol import reported_lost
from flexrun.rendezvous.state import MasterRecord, RoundRecord

MasterSource = Callable[[RoundRecord], MasterRecord | None]
"""A round's master address (``MASTER_ADDR``/``MASTER_PORT`` of its workers), published by
this node or awaited from the one that does; None: the round moved on meanwhile. Built
when the agent is (:func:`flexrun.agent.launch.build_agent`); the agent's loop calls it."""


class RoundStart(enum.Enum):
    """What :meth:`Runner.run_round` did."""

    FRESH = "fresh"
    """New worker processes started (those of an earlier round, if any, were stopped)."""
    CONTINUED = "continued"
    """The running workers carry on in the new round (live mode)."""


LOST_READ_S = 0.25
"""How often live mode reads the workers' reported lost time (their heartbeat files: a
worker removes its own when it leaves the loop, so the last report must be read before)."""


class LoopProgress:
    """Live mode's progress, as the agent sees it: the first time a worker of this node was
    seen in the training loop (its heartbeat), and the largest training time lost to
    disruptions that a worker reported (job-wide: :mod:`flexrun.train.live_goodput`).
    Live failures never count as a crash loop (the survivors' steps are not counted per
    failure)."""

    def __init__(self) -> None:
        self.first_loop: float | None = None
        self.lost = 0.0
        self._read_at: dict[Path, float] = {}  # (each heartbeat file: when last read, monotonic)

    def saw_loop(self, mono: float, heartbeat: Path | None = None) -> bool:
        """A worker is in the loop at ``mono`` (monotonic), its heartbeat file
        ``heartbeat`` read for its report every :data:`LOST_READ_S`; returns True."""
        if self.first_loop is None:
            self.first_loop = mono
        if (
            heartbeat is not None
            and mono - self._read_at.get(heartbeat, -LOST_READ_S) >= LOST_READ_S
        ):
            self._read_at[heartbeat] = mono
            self.lost = max(self.lost, reported_lost(heartbeat))
        return True

    def lost_s(self) -> float:
        return self.lost

    def made_progress(self) -> bool | None:
        return None

    def first_step_mono(self) -> float | None:
        return self.first_loop

    def kept_until(self) -> float | None:
        return None  # (a live failure keeps the survivors' work; nothing is stopped)


class Runner(Protocol):
    """This node's workers for the whole job."""

    @property
    def active(self) -> bool:
        """Workers of this node run (or are being replaced)."""
        ...

    def prepare_round(self, rnd: RoundRecord) -> None:
        """Round ``rnd`` (with this node a member) is about to start, before its master
        address is known: restart mode stops the workers of an earlier round (emitting
        ``restart`` and ``rendezvous_started``); live mode keeps them."""
        ...

    def run_round(self, rnd: RoundRecord, master: MasterRecord | None) -> RoundStart | None:
        """Make this node's workers train in round ``rnd`` (a member of it) whose master
        address is ``master`` (None where the mode needs none: live mode).

        Restart mode starts new workers (those of an earlier round stopped, if
        :meth:`prepare_round` did not); live mode starts them once, later only publishes
        the new membership. Emits the round's ``rendezvous_completed`` and each
        ``worker_started``. Returns None when no worker could start (restart mode without
        a master: the caller steps the rendezvous again).

        Raises:
            StoreUnavailable: the store failed while the round was being set up.
            OSError: a worker process could not be started.
        """
        ...

    def poll(self) -> Event | None:
        """Check the workers (and act on what the mode owns: hangs, replacements).

        Returns the policy event to feed (restart: :class:`~flexrun.agent.policy.Exited`
        when any worker has ended; live: ``LiveFailed`` / ``LiveFinished``), or None.

        Raises:
            StoreUnavailable: live mode could not publish a membership change.
        """
        ...

    def made_progress(self) -> bool | None:
        """Whether the workers of the current (or last) round completed a training step;
        None when that cannot be observed (no worker's progress hook is installed)."""
        ...

    def first_step_mono(self) -> float | None:
        """When the agent first saw a training step of the running workers (monotonic),
        or None: productive time counts only from it."""
        ...

    def lost_s(self) -> float:
        """Training time the running job lost without stopping its workers (live mode's
        pauses and slowed steps after a disruption, as its workers judged them; restart
        mode's losses are its stopped rounds: 0.0)."""
        ...

    def kept_until(self) -> float | None:
        """Until when (monotonic) the running workers' work survives their being stopped
        by a failure: when the state of the newest checkpoint they said can be resumed
        from was taken (``flexrun.train``); None: nothing is known to survive."""
        ...

    def tend(self) -> None:
        """Housekeeping between polls, when nothing else is urgent (refill warm spares)."""
        ...

    def stop(
        self,
        grace_s: float,
        *,
        on_first_exit: Callable[[], None] | None = None,
        sig: int = signal.SIGTERM,
    ) -> None:
        """Signal the workers (``sig``: SIGTERM unless the agent forwards another it
        caught), SIGKILL after ``grace_s``, reap them. ``on_first_exit``
        runs once, when the first worker has gone. Never raises for processes that are
        already gone."""
        ...

    def close(self) -> None:
        """Stop everything this runner started (spares too). Idempotent."""
        ...
