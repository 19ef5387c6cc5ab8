"""The workers' store (torch's ``TCPStore`` behind ``MASTER_ADDR``/``MASTER_PORT``): who hosts it.

Owns, for restart mode, whether the workers are clients of a store their agent hosts
(``TORCHELASTIC_USE_AGENT_STORE=True``, torchrun's default) or rank 0 hosts one itself, and
the hosting. torch (2.10 to 2.15) puts no per-attempt prefix on its keys there ("a new
TCPStore for every retry"), so each round's workers find a store without an earlier round's
keys: a fresh server (elastic) or the job's server emptied of them (static).

- Static job (:class:`WorkerStores`): torchrun's view exactly: the given master, where node
  rank 0's agent hosts the job's one store (flexrun's records under their own prefix, the
  workers' keys beside them, emptied between rounds), so that a static job needs only the
  port it is given.
- Elastic job (:class:`RoundStores`): the agent of the round's group rank 0 binds a store on
  a port the OS picks and publishes that as the round's master, so no worker ever connects
  before the store listens. (When rank 0 hosted it, a rank that came first waited out
  torch's connect back-off, a large share of a restart's time; ``bench/goodput_timeline.py``
  shows it.) As in torchrun, ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
  (and the etcd backends, whose torchrun handler does not share its store) leave it to rank 0.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from flexrun.config import RunConfig, StaticJob, backend_named
from flexrun.errors import ConfigError, StoreUnavailable
from flexrun.rendezvous import RendezvousHandler
from flexrun.rendezvous.masters import Masters
from flexrun.rendezvous.state import MasterRecord, RoundRecord
from flexrun.store.tcp import TcpStoreServer

log = logging.getLogger("flexrun.agent")

DISABLE_SHARING = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


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
    """The master of every round of a static job: the job's one store, which node rank 0's
    agent hosts at the given master for the whole job (torchrun's one port: flexrun's
    records and the workers' keys share the server, as torchrun's agent and workers do).

    Each round hands the workers a store without the keys of an earlier round's workers
    (torch's put no per-round prefix on them: a gloo or NCCL rendezvous would read a dead
    world's addresses): every other member marks that its earlier workers are stopped, node
    rank 0 then removes every key but the job's records and publishes the round's master,
    which the others await before their workers start.
    """

    def __init__(
        self,
        static: StaticJob,
        rdzv: RendezvousHandler,
        *,
        timeout_s: float,
        empty: Callable[[], int],
    ) -> None:
        self.static = static
        self.master = MasterRecord(static.master_addr, static.master_port)
        self._rdzv = rdzv
        self._timeout_s = timeout_s
        self._empty = empty

    def for_round(self, rnd: RoundRecord) -> MasterRecord | None:
        """The round's master once its store holds no earlier worker's key (None: the round
        moved on, or the hand-off took longer than the join timeout: the loop decides again)."""
        rdzv, marks = self._rdzv, Masters(self._rdzv.session)
        if rnd.group_rank(rdzv.me.node_id) != 0:
            marks.mark_stopped(rnd)
            found = rdzv.master_for(rnd, timeout_s=self._timeout_s)
            return self.master if found is not None else None
        if (
            rdzv.await_in_round(rnd.number, self._timeout_s, lambda: marks.all_stopped(rnd) or None)
            is None
        ):
            return None
        gone = self._empty()
        if gone:
            log.info("round %d: removed %d keys of earlier workers", rnd.number, gone)
        if rdzv.master_for(rnd, timeout_s=self._timeout_s, port=self.static.master_port) is None:
            return None
        log.info(
            "round %d: the workers' store is the job's, on port %d",
            rnd.number,
            self.static.master_port,
        )
        return self.master


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
