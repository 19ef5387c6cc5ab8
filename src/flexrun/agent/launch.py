"""From a validated RunConfig to a running agent: store connection (or hosting), event
log, the mode's runner and warm pools, metrics and resource sampling.

Owns the wiring only; the CLI calls :func:`launch` and turns its result into an exit code.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

from flexrun.agent.agent import Agent
from flexrun.agent.restart import RestartRunner
from flexrun.agent.runner import MasterSource, Runner
from flexrun.agent.warm import first_workers_warm, live_pool, restart_pool
from flexrun.agent.worker_store import RoundStores, WorkerStores, shares_agent_store
from flexrun.config import RunConfig, StoreSettings, backend_named
from flexrun.errors import ConfigError, StoreUnavailable
from flexrun.events import EventLog
from flexrun.rendezvous import NodeRecord, RendezvousHandler
from flexrun.rendezvous.keys import OWN_PREFIX
from flexrun.spares.pool import WarmPool
from flexrun.store.api import Store
from flexrun.store.factory import connect, delete_all_but, tcp_address

log = logging.getLogger("flexrun.agent")


def open_store(settings: StoreSettings, *, static: bool = False) -> tuple[Store, object | None]:
    """Connect to (or host, then connect to) the configured store.

    Returns the client and the hosted server object (keep it referenced), if any.

    Raises:
        StoreUnavailable: the endpoint cannot be reached within the connect timeout.
        ConfigError: the backend is not available in this installation; or, in a static
            job (``static``), the store's port cannot be bound on node rank 0.
    """
    if not backend_named(settings.backend).hosted:
        return connect(settings), None  # (a server of its own)
    from flexrun.store.tcp import TcpStoreServer

    server: TcpStoreServer | None = None
    if not settings.endpoints:
        server = TcpStoreServer("127.0.0.1", 0)
        host, port = "127.0.0.1", server.port
    else:
        host, port = settings.endpoints[0]
        if settings.host_store:
            try:
                server = TcpStoreServer("0.0.0.0", port)
                log.info("hosting the rendezvous store on port %d", port)
            except StoreUnavailable as exc:
                if static:
                    # Only node rank 0's agent serves a static job's store: whatever
                    # holds the port is not it (a squatter would be taken for the store).
                    raise ConfigError(
                        f"cannot host the job's store on port {port}: {_holder(port)} "
                        f"listens there ({exc}); free it, or give another --master-port"
                    ) from None
                # Someone (a `flexrun store`, or another agent on this host) already serves it.
                server = None
    return connect(settings, (host, port)), server


def _holder(port: int) -> str:
    """Who listens on ``port`` on this host, as far as this user may know ("a process")."""
    try:
        import psutil

        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr[1] == port:
                if conn.pid is None:
                    return "a process of another user"
                try:
                    return f"process {conn.pid} ({psutil.Process(conn.pid).name()})"
                except psutil.Error:
                    return f"process {conn.pid}"
    except (ImportError, OSError, RuntimeError):
        return "a process"  # (psutil cannot tell here: the message names the port alone)
    except Exception as exc:  # noqa: BLE001 (psutil.Error: not a reason to hide the port error)
        log.debug("cannot tell who listens on port %d: %s", port, exc)
    return "a process"


def build_agent(
    config: RunConfig,
    store: Store,
    *,
    events: EventLog,
    pool: WarmPool | None = None,
    live_spares: WarmPool | None = None,
) -> Agent:
    """This node's agent over ``store``, with the runner of ``config.mode``.

    Raises:
        ConfigError: live mode without the tcp store (a backend without live support).
    """
    static = config.static
    me = NodeRecord(
        config.node_id,
        config.local_addr,
        config.worker.nproc_per_node,
        pid=os.getpid(),
        rank=static.node_rank if static is not None else -1,
    )
    rdzv = RendezvousHandler(
        store, run_id=config.run_id, me=me, settings=config.rendezvous, events=events
    )
    runner: Runner
    masters: MasterSource | None = None  # (live mode's workers need none)
    if config.mode == "live":
        addr = tcp_address(store)  # (signed or not: live workers sign with the job secret)
        if addr is None:
            raise ConfigError("--mode live needs the tcp store")
        # Imported here: live mode's agent side is light, but keep restart mode's minimal.
        from flexrun.agent.live import LiveRunner

        runner = LiveRunner(
            config,
            node_id=me.node_id,
            store=store,
            store_addr=addr,
            events=events,
            pool=live_spares,
            wake=rdzv.session.changes.interrupt,
        )
    else:
        timeout = config.rendezvous.join_timeout_s
        on_close: Callable[[], None] | None = None
        agent_store: bool | None = None  # (a static job's: see RestartRunner)
        if static is not None:
            # torchrun's view: the workers meet at the given master, in the job's store
            # that node rank 0's agent hosts there, emptied of earlier workers' keys.
            masters = WorkerStores(
                static,
                rdzv,
                timeout_s=timeout,
                empty=lambda: delete_all_but(store, OWN_PREFIX),
            ).for_round
        elif shares_agent_store(config):
            # torchrun's default: the workers are clients of a store this (group rank 0's)
            # agent hosts, a fresh one each round, listening before the workers start.
            hosted = RoundStores(
                lambda rnd, port: rdzv.master_for(rnd, timeout_s=timeout, port=port),
                node_id=me.node_id,
                addr=me.addr,
            )
            masters, on_close, agent_store = hosted.for_round, hosted.close, True
        else:
            masters = lambda rnd: rdzv.master_for(rnd, timeout_s=timeout)  # noqa: E731
        runner = RestartRunner(
            config,
            node_id=me.node_id,
            events=events,
            pool=pool,
            on_close=on_close,
            agent_store=agent_store,
            wake=rdzv.session.changes.interrupt,
        )
    return Agent(config, rdzv, runner, events=events, masters=masters)


def make_run_dir(path: Path) -> None:
    """Create the run directory readable by its owner only (worker logs, events and the
    job's secret file live there); an existing one keeps its mode.

    Raises:
        ConfigError: it cannot be made (a parent that refuses, a full disk ...).
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.mkdir(mode=0o700, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--run-dir {path}: cannot create it ({exc.strerror or exc})") from None


def launch(config: RunConfig) -> int:
    """Run this node's agent to completion and return the process exit code.

    Raises:
        ConfigError: the run directory cannot be made.
    """
    make_run_dir(config.output.run_dir)
    events = EventLog(
        config.output.run_dir,
        run_id=config.run_id,
        node=config.node_id,
        echo_stderr=config.output.event_log_handler == "console",  # (torchrun's console handler)
    )
    pool = restart_pool(config)
    live_spares = live_pool(config)
    if live_spares is not None:
        # Live mode: this node's first workers boot now, before the agent imports torch
        # for its store client, and become the workers once the node is admitted.
        live_spares.fill(count=config.worker.nproc_per_node)
    elif pool is not None and first_workers_warm(config):
        # Restart mode: the warm pool's zygote imports torch once while this agent opens
        # its store and meets the others; the node's first workers are forked from it
        # (one import instead of one per worker: sooner and with less CPU,
        # bench/results/startup.txt), or taken warm from the node's `flexrun spares`.
        pool.fill()
    metrics = follower = None
    sampler = None
    store: Store | None = None
    server: object | None = None
    try:
        store, server = open_store(config.store, static=config.static is not None)
        if config.observe.metrics_port is not None:
            from flexrun.observe.metrics import serve_run_metrics

            # Fed from the node's event log, so worker events (checkpoints, throughput)
            # reach the metrics without another channel.
            metrics, follower = serve_run_metrics(
                config.output.run_dir,
                config.observe.metrics_port,
                node=config.node_id,
                run_id=config.run_id,
                host=config.observe.metrics_host,
            )
        if config.observe.resource_interval_s > 0:
            from flexrun.observe.resources import ResourceSampler

            sampler = ResourceSampler(
                events.emit,
                interval_s=config.observe.resource_interval_s,
                disk_path=str(config.output.run_dir),
            )
            sampler.start()
        return build_agent(
            config,
            store,
            events=events,
            pool=pool,
            live_spares=live_spares,
        ).run()
    finally:
        for p in (pool, live_spares):
            if p is not None:
                p.close()
        if sampler is not None:
            sampler.close()
        if follower is not None:
            follower.close()
        if metrics is not None:
            metrics.close()
        if store is not None:
            store.close()
        del server
