"""Membership rounds over a store: join, keep-alive, rank assignment, loss and scale-up."""

from flexrun.rendezvous.decide import (
    Exit,
    Propose,
    Run,
    Stop,
    View,
    Wait,
    decide,
    next_round,
    watches_membership,
)
from flexrun.rendezvous.handler import RendezvousHandler
from flexrun.rendezvous.state import Keys, MasterRecord, Member, NodeRecord, RoundRecord

__all__ = [
    "Exit",
    "Keys",
    "MasterRecord",
    "Member",
    "NodeRecord",
    "Propose",
    "RendezvousHandler",
    "RoundRecord",
    "Run",
    "Stop",
    "View",
    "Wait",
    "decide",
    "next_round",
    "watches_membership",
]
