"""Membership rounds over a store: join, keep-alive, rank assignment, loss and scale-up.

One node (the watcher) reads membership and proposes rounds; every other node reads a
small round header and its own slice (see :mod:`flexrun.rendezvous.state`).
"""

from flexrun.rendezvous.decide import (
    Exit,
    Propose,
    Run,
    Stop,
    View,
    Wait,
    decide,
    next_round,
)
from flexrun.rendezvous.follow import FollowView, follow, should_claim
from flexrun.rendezvous.handler import RendezvousHandler
from flexrun.rendezvous.state import (
    Claim,
    Keys,
    MasterRecord,
    Member,
    Members,
    NodeRecord,
    RoundRecord,
    Slice,
)

__all__ = [
    "Claim",
    "Exit",
    "FollowView",
    "Keys",
    "MasterRecord",
    "Member",
    "Members",
    "NodeRecord",
    "Propose",
    "RendezvousHandler",
    "RoundRecord",
    "Run",
    "Slice",
    "Stop",
    "View",
    "Wait",
    "decide",
    "follow",
    "next_round",
    "should_claim",
]
