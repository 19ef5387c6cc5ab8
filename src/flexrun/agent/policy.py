"""The agent's failure policy: ``(phase, event, now) -> (phase, actions)``, pure.

Owns what a node does when its workers end: finish the job, wait a moment for the real
cause of an echo ("connection closed by peer"), follow a round that a lost peer caused
instead of counting a failure, count a failure against ``--max-restarts`` (restart mode:
a new round; live mode: once per membership epoch), and which rank a hang blames. No
I/O, no clock (``now`` is an argument), no processes: :class:`flexrun.agent.agent.Agent`
carries the actions out, and unit tests drive this module with hand-made events.

Restart mode's phases::

    Idle --started--> Training --all ended 0--> (close the job)
                         |  failures, all echoes of a peer's death, some still running
                         v
                     AwaitingCause --all ended / CAUSE_WAIT_S / a real error--> conclude
    conclude: stop the workers; a failure a lost peer explains (several nodes, only
    echoes) -> Settling (wait up to settle_s for the rendezvous to move on: follow it, not
    counted), else -> Reporting (count it: the rendezvous starts the next round or ends
    the job). Reporting is retried until the store takes it (an outage), then Idle.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from flexrun.cause import FailureCause
from flexrun.config import RendezvousSettings

CAUSE_WAIT_S = 3.0
"""A failure seen only as "peer closed the connection" waits up to this long for the other
local workers to end by themselves before the root cause is chosen. Under load a rank that
raised can take seconds to exit (its traceback printed, its process group torn down) while its
peer's "connection closed" exit comes first; 1 s was too short on 2 loaded cores. The wait ends
as soon as a failure that is not an echo arrives, so it costs time only when none does."""


@dataclass(frozen=True, slots=True)
class PolicySettings:
    """The timings the policy needs, from the rendezvous settings."""

    cause_wait_s: float = CAUSE_WAIT_S
    stop_grace_s: float = 2.0
    """SIGTERM -> SIGKILL after a failure: workers blocked in a collective with a dead peer
    will not reach a clean exit, so do not wait long."""
    settle_s: float = 12.0
    """How long a failure that a lost peer may explain waits for the rendezvous to notice
    the peer (lost node, or its own failure report) before it is counted."""

    @classmethod
    def from_rendezvous(cls, s: RendezvousSettings) -> PolicySettings:
        # Twice the timeout: the lost peer may have refreshed its keep-alive just before it
        # died, and a store may round leases up (etcd counts whole seconds).
        return cls(settle_s=2 * s.heartbeat_timeout_s + 2 * s.heartbeat_interval_s)


# -- phases ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Idle:
    """No workers of this node run for a round."""


@dataclass(frozen=True, slots=True)
class Training:
    """This node's workers run for ``round``."""

    round: int
    counted_epoch: int = -1
    """Live mode: the membership epoch whose failure was last counted (several deaths in
    one epoch are one incident)."""


@dataclass(frozen=True, slots=True)
class AwaitingCause:
    """Workers of ``round`` failed, all as echoes so far; the others may still end."""

    round: int
    until: float


@dataclass(frozen=True, slots=True)
class Settling:
    """Workers of ``round`` were stopped after a failure a lost peer may explain."""

    round: int
    cause: FailureCause
    until: float


@dataclass(frozen=True, slots=True)
class Reporting:
    """A failure of ``round`` is to be counted against --max-restarts."""

    round: int
    cause: FailureCause


Phase = Idle | Training | AwaitingCause | Settling | Reporting


def hold_round(phase: Phase) -> int | None:
    """The round this node must not be asked to start again while in ``phase`` (what the
    rendezvous is told it runs): a node settling a failure still counts as its member."""
    if isinstance(phase, Training | AwaitingCause | Settling):
        return phase.round
    return None


# -- events ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class WorkerExit:
    """One local worker that has ended."""

    rank: int
    exit_code: int
    ended_at: float
    local_rank: int = 0
    pid: int = 0
    signal: str | None = None
    cause: FailureCause | None = None
    """Set when it failed (exit code != 0)."""
    consequence: bool = False
    """It failed only because a peer went away (see ``proc.diagnose.is_consequence``)."""


@dataclass(frozen=True, slots=True)
class Started:
    """This node's workers now run for ``round`` (restart mode: a fresh start)."""

    round: int


@dataclass(frozen=True, slots=True)
class Exited:
    """Restart mode: the workers that have ended so far, after a poll."""

    exits: tuple[WorkerExit, ...]
    all_done: bool
    peers: int
    """Nodes in the round (an echo explains nothing in a one-node job)."""


@dataclass(frozen=True, slots=True)
class LiveFailed:
    """Live mode: workers died (their slots are being refilled) under ``epoch``."""

    causes: tuple[FailureCause, ...]
    epoch: int


@dataclass(frozen=True, slots=True)
class LiveFinished:
    """Live mode: every worker of this node completed the training."""


@dataclass(frozen=True, slots=True)
class RoundSeen:
    """What the rendezvous says the current round is (None: the store lost it)."""

    number: int | None


@dataclass(frozen=True, slots=True)
class StoreBack:
    """The store answered again after an outage. A lost peer is only seen once the store
    is back and its keep-alive has expired there (etcd renews leases on restart), so a
    node settling a failure waits ``settle_s`` more from now."""


@dataclass(frozen=True, slots=True)
class Reported:
    """The failure being reported was taken by the rendezvous."""


@dataclass(frozen=True, slots=True)
class Halted:
    """This node's workers were stopped (the rendezvous said so, or the agent stops)."""


Event = Started | Exited | LiveFailed | LiveFinished | RoundSeen | StoreBack | Reported | Halted


# -- actions -----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class EmitExits:
    exits: tuple[WorkerExit, ...]


@dataclass(frozen=True, slots=True)
class StopWorkers:
    reason: str
    productive: bool
    """Count the time the workers ran as productive (not when they ended in a failure)."""
    grace_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Report:
    """Count ``cause`` against --max-restarts for ``round`` (``live``: keep the round)."""

    round: int
    cause: FailureCause
    live: bool = False


@dataclass(frozen=True, slots=True)
class Follow:
    """The rendezvous moved on after a lost peer: the failure is not counted."""

    cause: FailureCause


@dataclass(frozen=True, slots=True)
class Finish:
    """Every worker completed: mark the job finished and exit 0."""

    round: int


Action = EmitExits | StopWorkers | Report | Follow | Finish


@dataclass(frozen=True, slots=True)
class Decision:
    phase: Phase
    actions: tuple[Action, ...] = field(default=())


def step(phase: Phase, event: Event, now: float, settings: PolicySettings) -> Decision:
    """The phase after ``event`` at ``now``, and what to do about it."""
    if isinstance(event, Started):
        counted = phase.counted_epoch if isinstance(phase, Training) else -1
        return Decision(Training(event.round, counted))
    if isinstance(event, Halted):
        return Decision(phase if isinstance(phase, Reporting) else Idle())
    if isinstance(event, Reported):
        return Decision(Idle()) if isinstance(phase, Reporting) else Decision(phase)
    if isinstance(event, Exited) and isinstance(phase, Training | AwaitingCause):
        return _on_exits(phase, event, now, settings)
    if isinstance(event, StoreBack) and isinstance(phase, Settling):
        return Decision(
            Settling(phase.round, phase.cause, max(phase.until, now + settings.settle_s))
        )
    if isinstance(event, RoundSeen) and isinstance(phase, Settling):
        return _on_round(phase, event, now)
    if isinstance(event, LiveFailed) and isinstance(phase, Training):
        return _on_live_failures(phase, event)
    if isinstance(event, LiveFinished) and isinstance(phase, Training):
        return Decision(Idle(), (StopWorkers("finished", productive=True), Finish(phase.round)))
    return Decision(phase)


def _on_exits(
    phase: Training | AwaitingCause, event: Exited, now: float, settings: PolicySettings
) -> Decision:
    failed = [e for e in event.exits if e.exit_code != 0]
    if not failed:
        if event.all_done:
            return Decision(
                Idle(),
                (
                    EmitExits(event.exits),
                    StopWorkers("finished", productive=True),
                    Finish(phase.round),
                ),
            )
        return Decision(phase)
    echoes_only = all(e.consequence for e in failed)
    if echoes_only and not event.all_done:
        if isinstance(phase, Training):
            return Decision(AwaitingCause(phase.round, now + settings.cause_wait_s))
        if now < phase.until:
            return Decision(phase)
    first = first_failure(failed)
    assert first.cause is not None
    cause = first.cause.replace(round=phase.round)
    stop = (
        EmitExits(event.exits),
        StopWorkers("worker failure", productive=False, grace_s=settings.stop_grace_s),
    )
    if event.peers > 1 and echoes_only:
        return Decision(Settling(phase.round, cause, now + settings.settle_s), stop)
    return Decision(Reporting(phase.round, cause), (*stop, Report(phase.round, cause)))


def _on_round(phase: Settling, event: RoundSeen, now: float) -> Decision:
    if event.number is None or event.number != phase.round:
        return Decision(Idle(), (Follow(phase.cause),))
    if now >= phase.until:
        return Decision(Reporting(phase.round, phase.cause), (Report(phase.round, phase.cause),))
    return Decision(phase)


def _on_live_failures(phase: Training, event: LiveFailed) -> Decision:
    if not event.causes or event.epoch == phase.counted_epoch:
        return Decision(phase)  # several deaths under one epoch are one incident
    cause = event.causes[0].replace(round=phase.round)
    return Decision(
        Training(phase.round, counted_epoch=event.epoch),
        (Report(phase.round, cause, live=True),),
    )


SIMULTANEOUS_S = 1.0
"""Failures this close (seconds) to the first are candidates for having caused the others."""


def first_failure(failed: Sequence[WorkerExit]) -> WorkerExit:
    """The failure that caused the others: the earliest, preferring one that is not an
    echo among those within ``SIMULTANEOUS_S`` of it (a peer's death makes its neighbours
    fail a few milliseconds later with "connection closed by peer")."""
    first = min(failed, key=lambda e: e.ended_at)
    close = [e for e in failed if e.ended_at - first.ended_at < SIMULTANEOUS_S]
    primary = [e for e in close if not e.consequence]
    return min(primary or close, key=lambda e: e.ended_at)


def blame_hang(
    silent: Mapping[int, float],
    waiting: Mapping[int, bool],
    quiet: Mapping[int, float] | None = None,
) -> int:
    """The rank a hang is blamed on, given each rank silent past its limit (seconds without
    progress) and whether a rank's stacks show it waiting in a collective (those are victims
    of the one stuck elsewhere): the longest silent among the others. When every rank past
    its limit waits in a collective, the one stuck elsewhere may simply not have reached its
    own limit yet (it reported its last step a moment after them): then the longest-quiet
    rank of ``quiet`` (every watched rank's seconds without progress) whose stacks show it
    outside any collective, if it has been quiet at least half as long as the shortest of
    the silent ones; else the longest silent."""
    own = [r for r in silent if not waiting.get(r, False)]
    if own:
        return max(own, key=lambda r: silent[r])
    quiet = quiet or {}
    least = min(silent.values())
    stuck = [
        r
        for r, q in quiet.items()
        if r not in silent and waiting.get(r) is False and q >= least / 2
    ]
    if stuck:
        return max(stuck, key=lambda r: quiet[r])
    return max(silent, key=lambda r: silent[r])
