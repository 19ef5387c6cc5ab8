"""The workers' store of a static job: node rank 0's agent hosts a new one every round.

Owns torchrun's view for the workers of a static job: ``MASTER_ADDR``/``MASTER_PORT`` are
the given master, and with ``TORCHELASTIC_USE_AGENT_STORE=True`` every worker is a client
of a ``TCPStore`` there that the agent of node rank 0 hosts. torch (2.13) puts no per-attempt
prefix on its keys ("a new TCPStore for every retry"), so the store must be a fresh one each
round: the old one is dropped once this node's workers of the old round are stopped, and a
new one bound in its place before the new workers start (peers' workers retry connecting
until it is up). flexrun's own records live in another store (``StaticJob.store_port``).
"""

from __future__ import annotations

import logging
import time

from flexrun.config import StaticJob
from flexrun.errors import StoreUnavailable
from flexrun.rendezvous.state import MasterRecord, RoundRecord
from flexrun.store.tcp import TcpStoreServer

log = logging.getLogger("flexrun.agent")

REBIND_S = 5.0
"""How long to retry binding the master port while the previous round's store lets go."""


class WorkerStores:
    """The master of every round of a static job; node rank 0 also hosts its store."""

    def __init__(self, static: StaticJob) -> None:
        self.static = static
        self.master = MasterRecord(static.master_addr, static.master_port)
        self._server: TcpStoreServer | None = None

    def for_round(self, rnd: RoundRecord) -> MasterRecord:
        """The round's master; on node rank 0, a new store listening there first.

        Raises:
            StoreUnavailable: the master port stayed taken for :data:`REBIND_S`.
        """
        if self.static.node_rank != 0:
            return self.master
        self.close()
        deadline = time.monotonic() + REBIND_S
        while True:
            try:
                self._server = TcpStoreServer("0.0.0.0", self.static.master_port)
                break
            except StoreUnavailable:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.1)
        log.info(
            "round %d: the workers' store listens on port %d", rnd.number, self.static.master_port
        )
        return self.master

    def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
