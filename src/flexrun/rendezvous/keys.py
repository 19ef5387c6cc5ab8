"""The key names of one job's rendezvous records (the layout: :mod:`flexrun.rendezvous.state`)."""

from __future__ import annotations

OWN_PREFIX = "flexrun/"
"""Every job's records live under it (a static job's workers' keys beside them do not)."""


class Keys:
    """Key names of one job."""

    def __init__(self, run_id: str) -> None:
        self.root = f"{OWN_PREFIX}{run_id}/"
        self.watched = self.root + "s/"
        self.round_dir = self.watched + "round/"
        self.round = self.round_dir + "current"
        self.watcher = self.round_dir + "watcher"
        self.nodes = self.watched + "nodes/"
        self.asks = self.watched + "ask/"
        # Under the round directory that every node's change watch follows: a published
        # address wakes the members waiting for it (no polling).
        self.master_dir = self.round_dir + "master/"
        # A static job's members mark here that their workers of earlier rounds are stopped
        # (group rank 0 empties the workers' store, shared with these records, after all).
        self.stopped_dir = self.round_dir + "stopped/"
        self.heartbeats = self.root + "hb/"
        self.data = self.root + "r/"

    def node(self, node_id: str) -> str:
        return self.nodes + node_id

    def heartbeat(self, node_id: str) -> str:
        return self.heartbeats + node_id

    def master(self, round_number: int) -> str:
        return f"{self.master_dir}{round_number}"

    def stopped(self, round_number: int, node_id: str) -> str:
        return f"{self.stopped_dir}{round_number}/{node_id}"

    def ask(self, node_id: str) -> str:
        return self.asks + node_id

    def members_of(self, digest: str) -> str:
        """Prefix of everything written for the member list ``digest``."""
        return f"{self.data}{digest}/"

    def slice(self, digest: str, node_id: str) -> str:
        return f"{self.data}{digest}/s/{node_id}"

    def chunk(self, digest: str, index: int) -> str:
        return f"{self.data}{digest}/m/{index}"
