"""Pure decisions of the nodes that do not watch membership (followers), and of who
watches: ``(what a node read, now) -> action``.

Owns three rules. A follower reads the round header and its own slice, never the member
list, node records or keep-alives, and decides from those alone (:func:`follow`). Exactly
one node, the watcher, reads membership and proposes rounds; :func:`should_claim` says
when a node takes that role: at once when nobody holds it (the first node of a job) or
the holder gave it up (a graceful leave), once the holder's keep-alive has expired (a
bounded fallback: at most the heartbeat timeout plus two checks), and after a store
restart only once the old watcher had ``settle_s`` to claim it back; and
:func:`claim_check_interval` says how often a follower checks on the watcher. No I/O, no
clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from flexrun.rendezvous.decide import Action, Run, Stop, Wait, round_ended
from flexrun.rendezvous.state import PENDING, RUNNING, Claim, RoundRecord


@dataclass(frozen=True, slots=True)
class FollowView:
    """What a follower knows at one instant."""

    me: str
    round: RoundRecord | None
    """The current header with this node's slice (``round.mine``), if it read one."""
    member: bool | None
    """True: its slice places it in the round; False: the watcher says it is not in it;
    None: no slice found yet (it asked the watcher)."""
    running: int | None
    """The round whose workers this node runs now, if any."""


def follow(view: FollowView) -> Action:
    """The next thing a follower should do."""
    r = view.round
    ended = round_ended(r, view.running)
    if ended is not None:
        return ended
    if r is None:
        if view.running is not None:
            # The store lost the round (it restarted): workers keep training; the round
            # is restored by whoever knows it.
            return Wait("training; the round record is gone from the store")
        return Wait("waiting for the first round")
    if r.state == PENDING or r.state != RUNNING:
        if view.running is not None:
            return Stop("too few nodes: waiting for more")
        return Wait("waiting for nodes: the round is pending")
    if view.member is True:
        if view.running != r.number:
            return Run(r)
        return Wait("training")
    if view.member is False:
        if view.running is not None:
            return Stop(f"not a member of round {r.number}")
        return Wait(f"standby: not in round {r.number} ({len(r.members)} nodes)")
    if view.running is not None and view.running != r.number:
        return Stop(f"round {r.number} replaced round {view.running}")
    return Wait(f"round {r.number}: asked the watcher for this node's slice")


DEPUTIES = 3
"""Members of group rank 0..DEPUTIES of the running round check the watcher at the full rate."""
SPARSE_CHECKS = 10
"""The other members check the watcher this many times less often."""


EARLY_CHECKS = 3
"""A node outside a running round checks at the full rate this many times, then sparsely."""


def claim_check_interval(
    base_s: float,
    group_rank: int | None,
    unranked_checks: int = 0,
    *,
    deputy_s: float | None = None,
) -> float:
    """How often a follower reads the watcher claim and the holder's keep-alive, given
    its group rank in the running round (None: no round, not a member, or no slice yet)
    and, without one, how many checks it made since it last had one.

    Only one follower has to notice that the watcher died: the members of group rank
    0..:data:`DEPUTIES` of a running round check every ``deputy_s`` (default ``base_s``;
    the agent passes half the heartbeat interval, so a deputy reads each keep-alive write
    within that, and its local TTL judgement trails the holder's last write by no more;
    where the store says when a keep-alive it read expires, a deputy also checks right
    then: :class:`flexrun.rendezvous.claims.Claims`), the others every ``SPARSE_CHECKS x
    base_s`` (the bound should the watcher and every deputy die at once). Everyone
    checking cost the store 2N requests per ``base_s``: at 1024 nodes on etcd (3.5 s)
    ~590 a second, more than the keep-alives' 440; four deputies at 0.5 s cost 8. A node
    outside a running round (before the first, in a pending one, on standby) has no rank
    to be judged by: it checks every ``base_s`` for its first :data:`EARLY_CHECKS` checks
    (a node that just joined finds a dead watcher at once), then sparsely, so that a
    formation that takes minutes at thousands of nodes does not cost every node a claim
    read per ``base_s`` (4096 nodes, 40 s: ~16 requests a node). A watcher that dies
    while no round runs is then replaced within the heartbeat timeout plus ``SPARSE_CHECKS x
    base_s`` at worst, or at once by the next node to join; nothing trains meanwhile."""
    if group_rank is None:
        return base_s if unranked_checks < EARLY_CHECKS else base_s * SPARSE_CHECKS
    if group_rank <= DEPUTIES:
        return base_s if deputy_s is None else deputy_s
    return base_s * SPARSE_CHECKS


def should_claim(
    claim: Claim | None,
    watcher_alive: bool | None,
    *,
    me: str,
    was_watcher: bool,
    seen_rounds: bool,
    vacant_for_s: float,
    settle_s: float,
) -> bool:
    """Whether this node should try to become the watcher (compare-and-set on the claim).

    ``watcher_alive``: the holder's keep-alive as this node last judged it (None: not
    checked). ``seen_rounds``: this node has seen a round, so a missing claim means the
    store lost its state; ``vacant_for_s``: how long this node has seen it missing.
    """
    if claim is None:
        if not seen_rounds or was_watcher:
            return True  # a new job's first node; or the old watcher after a store restart
        return vacant_for_s >= settle_s
    if claim.node == me:
        return False
    if not claim.node:
        return True  # the watcher left and said so
    return watcher_alive is False


__all__ = [
    "DEPUTIES",
    "EARLY_CHECKS",
    "SPARSE_CHECKS",
    "FollowView",
    "claim_check_interval",
    "follow",
    "should_claim",
]
