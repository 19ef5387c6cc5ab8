"""Pure rendezvous decisions of a static (fixed-size) job: ``(view, now) -> action``.

Owns torchrun's static rendezvous as a rule set of the watcher (the same view, actions
and proposals as :func:`flexrun.rendezvous.decide.decide`, no second rendezvous):

- a round holds exactly ``max_nodes`` nodes, one per node rank ``0..N-1``, ordered by
  node rank (so ``GROUP_RANK`` is the node rank and global ranks follow torchrun's layout);
  a second node claiming a rank already taken waits as a standby;
- a member that is gone (its keep-alive expired, or it left) is a failure of the whole
  job, with a root cause naming the node and its rank and exit code 200
  (:data:`flexrun.exitcodes.NODE_LOST`): counted against ``--max-restarts``; past it the
  job's FAILED round, else a PENDING round (every node stops its workers);
- a PENDING round (or none yet) becomes a RUNNING one once every node rank is present,
  keeping the restart count (each RUNNING round of a job has its own, so workers'
  ``TORCHELASTIC_RESTART_COUNT`` store prefixes never collide).

No I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping

from flexrun.cause import FailureCause
from flexrun.config import RendezvousSettings
from flexrun.exitcodes import NODE_LOST
from flexrun.rendezvous.decide import (
    Action,
    Propose,
    Run,
    Stop,
    View,
    Wait,
    departed,
    job_ended,
)
from flexrun.rendezvous.decide import _eligible as eligible
from flexrun.rendezvous.state import (
    FAILED,
    PENDING,
    RUNNING,
    Member,
    NodeRecord,
    RoundRecord,
)


def by_rank(
    alive: Mapping[str, tuple[NodeRecord, int]], nnodes: int
) -> dict[int, tuple[NodeRecord, int]]:
    """Node rank -> the alive node that holds it (the earliest joined, if several claim it)."""
    out: dict[int, tuple[NodeRecord, int]] = {}
    for rec, rev in sorted(alive.values(), key=lambda v: (v[1], v[0].node_id)):
        if 0 <= rec.rank < nnodes and rec.rank not in out:
            out[rec.rank] = (rec, rev)
    return out


def static_members(
    alive: Mapping[str, tuple[NodeRecord, int]], nnodes: int
) -> tuple[Member, ...] | None:
    """The fixed world ordered by node rank, or None while a node rank is missing."""
    ranks = by_rank(alive, nnodes)
    if len(ranks) < nnodes:
        return None
    return tuple(Member(r.node_id, r.addr, r.nproc) for r, _ in (ranks[i] for i in range(nnodes)))


def missing_ranks(alive: Mapping[str, tuple[NodeRecord, int]], nnodes: int) -> list[int]:
    ranks = by_rank(alive, nnodes)
    return [i for i in range(nnodes) if i not in ranks]


def lost_cause(r: RoundRecord, gone: list[str], lost: bool, timeout_s: float) -> FailureCause:
    """The root cause of a static round that lost member(s) ``gone`` (first named)."""
    ids = r.member_ids
    node = gone[0]
    how = f"no keep-alive for {timeout_s:g}s" if lost else "it left the job"
    others = f" (and {', '.join(gone[1:])})" if len(gone) > 1 else ""
    return FailureCause(
        exit_code=NODE_LOST,
        message=(
            f"node {node} (node rank {ids.index(node)}) of the static job was lost: {how}{others}"
        ),
        node=node,
        round=r.number,
        kind="node_lost",
    )


def after_loss(
    r: RoundRecord, cause: FailureCause, settings: RendezvousSettings, reason: str
) -> RoundRecord:
    """The round after a static round lost a node: PENDING (waiting for the world to be
    whole again) with the loss counted, or the job's FAILED round past --max-restarts."""
    restarts = r.restarts + 1
    if restarts > settings.max_restarts:
        return RoundRecord(r.number + 1, FAILED, (), restarts, reason, NODE_LOST, cause)
    return RoundRecord(r.number + 1, PENDING, (), restarts, reason, 0, cause)


def decide_static(view: View, settings: RendezvousSettings) -> Action:
    """The next thing the watcher of a static job should do."""
    r = view.round
    n = settings.max_nodes
    ended = job_ended(view)
    if ended is not None:
        return ended
    alive = eligible(view)
    world = static_members(alive, n)
    if (r is None or r.number < view.floor) and view.floor > 0:
        # The store lost its state (the host of node rank 0 restarted): form the world
        # again above every round seen, once the nodes had time to re-register.
        if view.now < view.settle_until:
            return Wait("store restarted: waiting for the nodes to re-register")
        if world is not None:
            number = max(r.number if r is not None else 0, view.floor) + 1
            rec = RoundRecord(number, RUNNING, world, 0, "store_restarted")
            return Propose(rec, r.number if r is not None else 0, joined=rec_ids(rec))
        if view.running is not None:
            return Stop("the static world is not whole: waiting for every node rank")
        return Wait(f"waiting for node ranks {missing_ranks(alive, n)}")

    if r is not None and r.state == RUNNING:
        members = r.member_ids
        gone = departed(members, alive, view)
        if gone is not None:
            cause = lost_cause(
                r,
                [m for m in members if m in gone.lost + gone.left],
                bool(gone.lost),
                settings.heartbeat_timeout_s,
            )
            return Propose(
                after_loss(r, cause, settings, gone.reason),
                r.number,
                lost=gone.lost,
                left=gone.left,
            )
        if view.me in members:
            return Run(r) if view.running != r.number else Wait("training")
        if view.running is not None:
            return Stop(f"not a member of round {r.number}")
        return Wait(f"standby: every node rank of round {r.number} is taken")

    # No round yet, or PENDING: start once every node rank is present.
    if view.running is not None:
        return Stop("the static world is not whole: waiting for every node rank")
    if world is None:
        return Wait(f"waiting for node ranks {missing_ranks(alive, n)} of {n}")
    restarts = r.restarts if r is not None else 0
    reason = "start" if r is None else "nodes_returned"
    number = (r.number if r is not None else 0) + 1
    rec = RoundRecord(number, RUNNING, world, restarts, reason)
    return Propose(rec, r.number if r is not None else 0, joined=rec_ids(rec))


def store_host_lost(
    node_rank: int, master: str, outage_s: float, settings: RendezvousSettings
) -> FailureCause | None:
    """Node rank 0 hosts a static job's store: another node that cannot reach the store
    for longer than the heartbeat timeout has lost node rank 0, and the job ends with exit
    200 whatever ``--max-restarts`` says (the store and its rounds went with that node;
    the scheduler restarts the world). None: not (yet) a loss."""
    if node_rank == 0 or outage_s <= settings.heartbeat_timeout_s:
        return None
    return FailureCause(
        exit_code=NODE_LOST,
        message=(
            f"node rank 0 of the static job was lost: its store at {master} has been "
            f"unreachable for {outage_s:.1f}s (heartbeat timeout "
            f"{settings.heartbeat_timeout_s:g}s)"
        ),
        node="node-rank-0",
        kind="node_lost",
    )


def rec_ids(rec: RoundRecord) -> tuple[str, ...]:
    return tuple(rec.member_ids)


__all__ = ["after_loss", "by_rank", "decide_static", "static_members", "store_host_lost"]
