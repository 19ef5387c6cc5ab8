"""The workers' store (torch's ``TCPStore`` behind ``MASTER_ADDR``/``MASTER_PORT``): who hosts it.

Owns, for restart mode, whether the workers are clients of a store their agent hosts
(``TORCHELASTIC_USE_AGENT_STORE=True``, torchrun's default) or rank 0 hosts one itself, and
the hosting. torch (2.10 to 2.15) puts no per-attempt prefix on its keys there ("a new
TCPStore for every retry"), so a hosted store is a fresh one each round: the old one is
dropped once this node's workers of the old round are stopped, and a new one bound before
the new workers start.

- Static job (:class:`WorkerStores`): torchrun's view exactly: the given master, where node
  rank 0's agent hosts the store (peers' workers retry connecting until it is up). flexrun's
  own records live in another store (``StaticJob.store_port``).
- Elastic job (:class:`RoundStores`): the agent of the round's group rank 0 binds a store on
  a port the OS picks and publishes that as the round's master, so no worker ever connects
  before the store listens. (When rank 0 hosted it, a rank that came first waited out
  torch's connect back-off, a large share of a restart's time; ``bench/goodput_timeline.py``
  shows it.) As in torchrun, ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
  (and the etcd backends, whose torchrun handler does not share its store) leave it to rank 0.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from flexrun.config import RunConfig, StaticJob, backend_named
from flexrun.errors import ConfigError, StoreUnavailable
from flexrun.rendezvous.state import MasterRecord, RoundRecord
from flexrun.store.tcp import TcpStoreServer

log = logging.getLogger("flexrun.agent")

DISABLE_SHARING = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"

REBIND_S = 5.0
"""How long to retry binding the master port while the previous round's store lets go."""


def shares_agent_store(config: RunConfig) -> bool:
    """Whether restart mode's workers are clients of a store their agent hosts (torchrun's
    ``TORCHELASTIC_USE_AGENT_STORE``): always in a static job; in an elastic one over the
    tcp store unless ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, as torchrun's c10d handler."""
    if config.mode != "restart":
        return False
    if config.static is not None:
        return True
    if not backend_named(config.store.backend).shares_worker_store:
        return False
    return config.worker.environ.get(DISABLE_SHARING, "0") != "1"


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


class RoundStores:
    """The master of every round of an elastic job, hosted by the agent of group rank 0.

    ``publish(rnd, port)`` is the rendezvous' ``master_for``: it publishes this node's
    address with ``port`` (the first writer wins) or, on the other nodes, waits for the
    published master (None: the round moved on).
    """

    def __init__(
        self,
        publish: Callable[[RoundRecord, int], MasterRecord | None],
        *,
        node_id: str,
        addr: str,
    ) -> None:
        self._publish = publish
        self.node_id = node_id
        self._addr = addr
        self._server: TcpStoreServer | None = None

    def for_round(self, rnd: RoundRecord) -> MasterRecord | None:
        """The round's master; on group rank 0's node, a fresh store listening there first.

        Raises:
            StoreUnavailable: no port could be bound on this node.
        """
        self.close()  # this node's workers of the last round are stopped
        if rnd.group_rank(self.node_id) != 0:
            return self._publish(rnd, 0)
        server = self._listen()
        master = self._publish(rnd, server.port)
        if master is None or master.port != server.port:
            server.close()  # another master was published first: it is the round's
            return master
        self._server = server
        log.info("round %d: the workers' store listens on port %d", rnd.number, server.port)
        return master

    def _listen(self) -> TcpStoreServer:
        """On the address this node advertises (loopback for a one-host job: nothing
        else can reach it); where that is not an address of this host (a name behind NAT),
        on every interface, as torch's own store, dual-stack where the host has IPv6."""
        try:
            return TcpStoreServer(self._addr, 0)
        except (StoreUnavailable, ConfigError) as exc:
            log.info("the workers' store cannot bind %s (%s): every interface", self._addr, exc)
        try:
            return TcpStoreServer("::", 0)
        except StoreUnavailable:
            return TcpStoreServer("0.0.0.0", 0)

    def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
