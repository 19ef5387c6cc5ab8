"""Pure rendezvous decisions of the watcher: ``(view of the store, now) -> action``.

Owns the membership rules (rounds, MIN:MAX, last call, stable ranks,
loss detection, scale-up, closing) as the one node that watches membership applies them
(:mod:`flexrun.rendezvous.follow` has the other nodes' rules), and writes the recovery
rules' verdicts (:mod:`flexrun.recovery`: restart budget, crash loop) into rounds. It performs no I/O and
reads no clock: the handler builds a :class:`View`, calls :func:`decide`, and carries out
the action. Unit tests drive it with hand-made views and a fake ``now``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from flexrun.cause import FailureCause
from flexrun.config import RendezvousSettings
from flexrun.errors import RendezvousTimeout
from flexrun.exitcodes import NO_PROGRESS
from flexrun.recovery import (
    CrashLoop,
    Exhausted,
    RecoverySettings,
    live_failure,
    over_budget,
    restart_failure,
)
from flexrun.rendezvous.state import (
    CLOSED,
    FAILED,
    FINISHED_EARLIER,
    PENDING,
    RUNNING,
    Member,
    NodeRecord,
    RoundRecord,
)


@dataclass(frozen=True, slots=True)
class View:
    """What one agent knows at one instant."""

    me: str
    round: RoundRecord | None
    alive: Mapping[str, tuple[NodeRecord, int]]
    """Nodes with a fresh keep-alive: id -> (record, revision at which it joined)."""
    registered: frozenset[str]
    """Nodes with a node record, alive or not (a member missing here left gracefully)."""
    running: int | None
    """The round whose workers this agent runs now, if any."""
    now: float
    candidates_since: float
    """When the set of alive nodes last changed (starts the last-call window)."""
    settle_until: float = 0.0
    """After the store lost its state (restarted), members are not declared gone before
    this time: they need a keep-alive interval or two to re-register."""
    floor: int = 0
    """The highest round number this agent has seen. Round numbers never go back: a
    store that restarted (and lost the round) must not see a round numbered at or below
    it again, or the checkpoint fence refuses every writer of the new rounds."""
    unconfirmed: frozenset[str] = frozenset()
    """Alive nodes whose keep-alive this agent has not yet seen renewed, on a store whose
    readers judge TTLs themselves (tcp): a dead node's last keep-alive looks fresh to a
    reader that sees it for the first time. Such a node is not taken in as a newcomer
    until it beats again (members stay judged by their keep-alive as usual)."""


@dataclass(frozen=True, slots=True)
class Wait:
    reason: str


@dataclass(frozen=True, slots=True)
class Run:
    round: RoundRecord


@dataclass(frozen=True, slots=True)
class Stop:
    reason: str


@dataclass(frozen=True, slots=True)
class Exit:
    code: int
    reason: str
    root_cause: FailureCause | None = None


@dataclass(frozen=True, slots=True)
class Propose:
    """Replace the round record (expected at ``expected_number``) with ``record``."""

    record: RoundRecord
    expected_number: int
    lost: tuple[str, ...] = ()
    left: tuple[str, ...] = ()
    joined: tuple[str, ...] = ()


Action = Wait | Run | Stop | Exit | Propose


def order_members(
    previous: Sequence[str], alive: Mapping[str, tuple[NodeRecord, int]], max_nodes: int
) -> list[Member]:
    """Survivors keep their relative order; newcomers follow in join order; cap at MAX."""
    ids = [n for n in previous if n in alive]
    newcomers = sorted((n for n in alive if n not in ids), key=lambda n: (alive[n][1], n))
    out = []
    for node_id in (ids + newcomers)[:max_nodes]:
        rec = alive[node_id][0]
        out.append(Member(rec.node_id, rec.addr, rec.nproc))
    return out


def next_round(
    current: RoundRecord | None,
    alive: Mapping[str, tuple[NodeRecord, int]],
    settings: RendezvousSettings,
    reason: str,
    *,
    failure: bool = False,
    root_cause: FailureCause | None = None,
    floor: int = 0,
) -> RoundRecord:
    """The round that follows ``current`` given who is alive (pure); numbered above both
    ``current`` and ``floor`` (the highest round the caller has seen)."""
    number = max(current.number if current is not None else 0, floor) + 1
    restarts = (current.restarts if current is not None else 0) + (1 if failure else 0)
    cause = root_cause
    if failure and over_budget(restarts, RecoverySettings.of(settings)):
        return _exhausted(number, restarts, cause)
    previous = current.member_ids if current is not None else []
    members = order_members(previous, alive, settings.max_nodes)
    if len(members) < settings.min_nodes:
        return RoundRecord(number, PENDING, (), restarts, reason, 0, cause)
    return RoundRecord(number, RUNNING, tuple(members), restarts, reason, 0, cause)


def _exhausted(number: int, restarts: int, cause: FailureCause | None) -> RoundRecord:
    code = (cause.exit_code if cause is not None else 1) or 1
    return RoundRecord(number, FAILED, (), restarts, "restarts_exhausted", code, cause)


def _no_progress(number: int, restarts: int, stalled: int, c: FailureCause | None) -> RoundRecord:
    return RoundRecord(number, FAILED, (), restarts, "no_progress", NO_PROGRESS, c, stalled=stalled)


def counted_failure(
    current: RoundRecord,
    settings: RecoverySettings,
    cause: FailureCause | None,
    *,
    now: float = 0.0,
    progressed: bool | None = None,
) -> RoundRecord:
    """Live mode: ``current`` with one more failure counted against --max-restarts (the
    members and the round number stay: survivors keep running), or the job's FAILED round
    once restarts are spent (:func:`flexrun.recovery.live_failure`: per window, ``now``
    wall time)."""
    v = live_failure(current.restarts, current.stalled, current.window, now, progressed, settings)
    if isinstance(v, CrashLoop):
        return _no_progress(current.number + 1, v.restarts, v.stalled, cause)
    if isinstance(v, Exhausted):
        return _exhausted(current.number + 1, v.restarts, cause)
    return dataclasses.replace(
        current,
        restarts=v.restarts,
        stalled=v.stalled,
        window=v.window,
        exit_code=0,
    )


def failure_round(
    current: RoundRecord,
    settings: RecoverySettings,
    cause: FailureCause | None,
    *,
    floor: int = 0,
    progressed: bool | None = None,
) -> RoundRecord:
    """Restart mode: the round after a worker failure, with the same members (their
    member list, and so its slices, are reused: any node can propose it with one
    compare-and-set); the watcher removes a member that is also gone in a round of its
    own. The job's FAILED round once restarts are spent or in a crash loop (exit code 86,
    NO_PROGRESS), as :func:`flexrun.recovery.restart_failure` judges."""
    number = max(current.number, floor) + 1
    v = restart_failure(current.restarts, current.stalled, current.window, progressed, settings)
    if isinstance(v, CrashLoop):
        return _no_progress(number, v.restarts, v.stalled, cause)
    if isinstance(v, Exhausted):
        return _exhausted(number, v.restarts, cause)
    return dataclasses.replace(
        current,
        number=number,
        restarts=v.restarts,
        stalled=v.stalled,
        reason="failure",
        exit_code=0,
        root_cause=cause,
    )


def _eligible(view: View) -> Mapping[str, tuple[NodeRecord, int]]:
    """The alive nodes a round may include: members of the current round, this agent, and
    newcomers whose keep-alive this agent has seen renewed (see ``View.unconfirmed``).

    Without it, a node killed just before another node started counts as alive for a
    full TTL from the newcomer's first sight: the newcomer proposes it back and an older
    node drops it again, round after round (a round storm seen in the chaos runs). The
    very first round (no round record yet) takes everyone present, for a fast start."""
    if not view.unconfirmed or view.round is None and view.floor == 0:
        return view.alive
    members = set(view.round.member_ids) if view.round is not None else set()
    return {
        n: v
        for n, v in view.alive.items()
        if n not in view.unconfirmed or n in members or n == view.me
    }


@dataclass(frozen=True, slots=True)
class Departed:
    """Members of the running round that are gone: ``lost`` (their keep-alive expired, the
    node record is still there) and ``left`` (they left gracefully)."""

    lost: tuple[str, ...]
    left: tuple[str, ...]

    @property
    def reason(self) -> str:
        return "node_lost" if self.lost else "node_left"


def departed(members: Sequence[str], alive: Collection[str], view: View) -> Departed | None:
    """Who of ``members`` is gone, once the settle time after a store restart is over."""
    if view.now < view.settle_until:
        return None
    gone = [m for m in members if m not in alive]
    if not gone:
        return None
    return Departed(
        lost=tuple(m for m in gone if m in view.registered),
        left=tuple(m for m in gone if m not in view.registered),
    )


def job_ended(view: View) -> Action | None:
    """What to do once the job failed or finished (its round FAILED or CLOSED), else None."""
    return round_ended(view.round, view.running)


def round_ended(r: RoundRecord | None, running: int | None) -> Action | None:
    """What a node running ``running`` does once round ``r`` FAILED or CLOSED, else None.

    A node whose workers run the round that finished waits for them (they completed the
    same training and end by themselves). A round closed by a node that finished an
    earlier one (:data:`FINISHED_EARLIER`) will never train: its workers are stopped."""
    if r is not None and r.state == FAILED:
        return Exit(r.exit_code or 1, f"job failed: {r.reason}", r.root_cause)
    if r is not None and r.state == CLOSED:
        if running != r.number:
            return Exit(0, "job finished")
        if r.reason == FINISHED_EARLIER:
            return Exit(0, f"job finished by a node of an earlier round than {r.number}")
        return Wait("job finishing: waiting for local workers")
    return None


def decide(view: View, settings: RendezvousSettings) -> Action:
    """The next thing this agent should do."""
    r = view.round
    ended = job_ended(view)
    if ended is not None:
        return ended

    alive = _eligible(view)
    window_over = view.now - view.candidates_since >= settings.last_call_s

    if (r is None or r.number < view.floor) and view.floor > 0:
        # The store lost its state (restarted): the round is gone, or a node that never
        # saw the old rounds formed a lower one. Once the nodes had time to re-register,
        # form the next round above every one seen (never a lower number).
        if view.now < view.settle_until:
            return Wait("store restarted: waiting for the nodes to re-register")
        if len(alive) >= settings.min_nodes:
            rec = next_round(r, alive, settings, "store_restarted", floor=view.floor)
            return Propose(rec, r.number if r is not None else 0, joined=tuple(rec.member_ids))
        if view.running is not None:
            return Stop("too few nodes: waiting for more")
        return Wait(f"waiting for nodes: {len(alive)} present, MIN is {settings.min_nodes}")

    if r is not None and r.state == RUNNING:
        members = r.member_ids
        gone = departed(members, alive, view)
        if gone is not None:
            return Propose(
                next_round(r, alive, settings, gone.reason),
                r.number,
                lost=gone.lost,
                left=gone.left,
            )
        waiters = [n for n in alive if n not in members]
        if (
            waiters
            and len(members) < settings.max_nodes
            and (len(members) + len(waiters) >= settings.max_nodes or window_over)
        ):
            rec = next_round(r, alive, settings, "scale_up")
            return Propose(
                rec, r.number, joined=tuple(n for n in rec.member_ids if n not in members)
            )
        if view.me in members:
            if view.running != r.number:
                return Run(r)
            return Wait("training")
        if view.running is not None:
            return Stop(f"not a member of round {r.number}")
        return Wait(
            f"standby: round {r.number} is full ({len(members)} of max {settings.max_nodes} nodes)"
            if len(members) >= settings.max_nodes
            else f"waiting to join round {r.number + 1}"
        )

    # No round yet, or too few nodes (PENDING).
    if view.running is not None:
        return Stop("too few nodes: waiting for more")
    if r is None and _expected_missing(len(alive), view, settings):
        return Wait(
            f"waiting for the nodes starting together: {len(alive)} of "
            f"{min(settings.expected_nodes, settings.max_nodes)} present"
        )
    if len(alive) >= settings.min_nodes and (len(alive) >= settings.max_nodes or window_over):
        reason = "start" if r is None else "nodes_returned"
        rec = next_round(r, alive, settings, reason)
        return Propose(rec, r.number if r is not None else 0, joined=tuple(rec.member_ids))
    return Wait(f"waiting for nodes: {len(alive)} present, MIN is {settings.min_nodes}")


def _expected_missing(present: int, view: View, settings: RendezvousSettings) -> bool:
    """Whether the job's first round still waits for nodes known to be starting with this
    one (``expected_nodes``: a Slurm step's tasks, whose ``srun`` starts may be seconds
    apart on a loaded machine), rather than closing after the last call with fewer and
    re-forming the moment the others arrive. The wait ends ``expected_wait_s`` after the
    last arrival, so a task that never starts costs that, not the job."""
    want = min(settings.expected_nodes, settings.max_nodes)
    return present < want and view.now - view.candidates_since < settings.expected_wait_s


def within_join_timeout(
    action: Action,
    rnd: RoundRecord | None,
    running: int | None,
    settings: RendezvousSettings,
    waited_s: float,
) -> Action:
    """``action``, unless a node that has waited ``waited_s`` since it joined is past the
    join timeout without a round of MIN nodes.

    Raises:
        RendezvousTimeout: no round with MIN nodes formed within the join timeout.
    """
    if (
        isinstance(action, Wait)
        and (rnd is None or rnd.state not in (CLOSED, FAILED))
        and running is None
        and (rnd is None or len(rnd.members) < settings.min_nodes)
        and waited_s > settings.join_timeout_s
    ):
        raise RendezvousTimeout(
            f"rendezvous timed out after {settings.join_timeout_s:g}s: --nnodes MIN is "
            f"{settings.min_nodes} and no round with that many nodes formed; start more "
            "nodes or lower MIN"
        )
    return action
