"""Configuration: frozen dataclasses, and the one place that reads ``os.environ``.

Owns what a validated ``flexrun run`` is (:class:`RunConfig` and its parts) and how it is
built from parsed flags, ``PET_*`` variables and ``--rdzv-conf``, with precedence CLI >
environment (``PET_*``) > default, as torchrun. Library code receives these objects and
never reads the environment itself. It does not act on them. The value parsers live in
:mod:`flexrun.config.parsing`, the ``--rdzv-conf`` keys in :mod:`flexrun.config.rdzv_conf`, the
address choice in :mod:`flexrun.config.netaddr`, the job's shape (local, dynamic, static) in
:mod:`flexrun.config.topology`.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from flexrun.config.backends import backend_named
from flexrun.config.run_parts import (
    DEFAULT_SIGNALS,
    START_METHODS,
    ObserveSettings,
    OutputSettings,
    SpareSettings,
    StdStreams,
    WorkerSpec,
)
from flexrun.errors import ConfigError

log = logging.getLogger("flexrun.config")

__all__ = ["DEFAULT_SIGNALS", "START_METHODS", "StdStreams"]


@dataclass(frozen=True, kw_only=True, slots=True)
class RendezvousSettings:
    """How nodes meet: timing of membership decisions."""

    min_nodes: int = 1
    """Fewest nodes a round may have."""
    max_nodes: int = 1
    """Most nodes a round may have; extra nodes wait as standbys."""
    last_call_s: float = 1.0
    """After MIN nodes are present (and fewer than MAX), wait this long for more before
    closing the round. Short by default: a lone joiner should not wait 30 s."""
    join_timeout_s: float = 600.0
    """How long a node waits for MIN nodes before giving up (exit 2)."""
    expected_nodes: int = 0
    """Nodes known to be starting together (a Slurm step's tasks, up to MAX): the job's
    first round waits for this many, up to ``expected_wait_s`` after the last one
    arrived, instead of closing after the last call with whoever is there; 0: unknown."""
    expected_wait_s: float = 30.0
    """How long the first round waits for an expected node that has not arrived yet, after
    the last arrival (``flexrun run``: 30 s, or a quarter of the join timeout if shorter)."""
    heartbeat_interval_s: float = 1.0
    """How often an agent refreshes its keep-alive."""
    heartbeat_timeout_s: float = 5.0
    """A node whose keep-alive is older than this is declared lost."""
    max_restarts: int = 3
    """Failures tolerated per job (membership changes do not count); per
    ``restart_window_s`` when that is set (live mode's default)."""
    restart_window_s: float = 0.0
    """0: ``max_restarts`` counts every failure of the job (torchrun's rule, restart
    mode). Positive: it counts the failures of the current window of this many seconds (a
    window opens at the first failure after the last one closed; the round's ``restarts``
    counts its failures): live mode's rule, so that a long job is not ended by its
    hundredth failure in a month."""
    crash_loop_restarts: int = 3
    """A job whose failed rounds completed no step this many restarts in a row (and then
    once more) ends with exit code 86 (NO_PROGRESS: do not requeue); 0: off."""
    static: bool = False
    """A fixed world (torchrun's static rendezvous, :class:`StaticJob`): a round holds
    exactly ``max_nodes`` nodes ordered by node rank, and a lost node is a failure of the
    job (exit 200, or a restart of the whole world once every node rank is back)."""

    def __post_init__(self) -> None:
        if self.min_nodes < 1 or self.max_nodes < self.min_nodes:
            raise ConfigError(f"nnodes {self.min_nodes}:{self.max_nodes}: need 1 <= MIN <= MAX")
        if self.heartbeat_interval_s <= 0:
            raise ConfigError("heartbeat_interval must be positive")
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ConfigError(
                f"heartbeat_timeout ({self.heartbeat_timeout_s:g}s) must exceed "
                f"heartbeat_interval ({self.heartbeat_interval_s:g}s)"
            )
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts {self.max_restarts}: must be 0 or more")
        if self.expected_nodes < 0 or self.expected_wait_s < 0:
            raise ConfigError(
                f"expected nodes {self.expected_nodes} within {self.expected_wait_s:g}s: "
                "neither may be negative"
            )
        if self.crash_loop_restarts < 0:
            raise ConfigError(
                f"--crash-loop-restarts {self.crash_loop_restarts}: must be 0 (off) or more"
            )


EXPECTED_WAIT_S = 30.0
"""``RendezvousSettings.expected_wait_s`` of ``flexrun run`` (torchrun's last call)."""
LIVE_MAX_RESTARTS = 10
"""Live mode's --max-restarts when none is given: failures per LIVE_RESTART_WINDOW_S."""
LIVE_RESTART_WINDOW_S = 3600.0
"""Live mode counts --max-restarts per window of this many seconds (restart mode: per job)."""
CRASH_LOOP_RESTARTS = 3
"""--crash-loop-restarts' default."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StoreSettings:
    """Which store the rendezvous uses and how to reach it."""

    backend: str = "c10d"
    """One of c10d, tcp, static (embedded tcp store), etcd, etcd-v3."""
    endpoints: tuple[tuple[str, int], ...] = ()
    """Where the store listens; empty with standalone (a free local port is used)."""
    host_store: bool = False
    """Run the tcp store inside this agent (standalone, or the endpoint is this host)."""
    connect_timeout_s: float = 30.0
    """How long to keep trying to reach the store before exit 2."""
    op_timeout_s: float | None = None
    """One store operation's timeout (``--rdzv-conf read_timeout``): the tcp client's
    ``op_timeout_s``; for etcd it is passed as ``request_timeout`` in ``conf``. None: the
    backend's default."""
    conf: Mapping[str, str] = field(default_factory=dict)
    """Remaining --rdzv-conf options, passed to the backend (e.g. TLS for etcd)."""
    secret: bytes | None = field(default=None, repr=False)
    """The job secret that authenticates every record (see
    :func:`flexrun.config.credentials.store_credentials`); ``flexrun.store.factory.connect``
    then returns a signing store."""
    password: str | None = field(default=None, repr=False)
    """The etcd user's password (``--rdzv-conf user=NAME``), never from the command line."""

    def __post_init__(self) -> None:
        backend_named(self.backend)  # (ConfigError: unknown)


@dataclass(frozen=True, kw_only=True, slots=True)
class StaticJob:
    """A fixed-size job, torchrun's static rendezvous: ``nnodes`` nodes, each told its rank.

    Formed from ``--nnodes N --node-rank R --master-addr A --master-port P`` (or their
    ``PET_*`` forms, as Kubeflow Trainer v2 sets them) without ``--rdzv-endpoint``, or
    from ``--rdzv-backend static``. The agent must give this node ``GROUP_RANK`` =
    ``node_rank`` and ranks ``node_rank * nproc ...``, workers ``MASTER_ADDR`` /
    ``MASTER_PORT`` = ``master_addr`` / ``master_port`` (the store node rank 0 hosts there,
    ``TORCHELASTIC_USE_AGENT_STORE=True`` as torchrun), and end the job with exit 200
    (``exitcodes.NODE_LOST``) when a node's heartbeat stops.
    """

    nnodes: int
    """The world's node count (torchrun: MAX of ``--nnodes``)."""
    node_rank: int
    """This node's rank, 0..nnodes-1 (``--node-rank``)."""
    master_addr: str
    """Where node rank 0 hosts the store (``--master-addr``)."""
    master_port: int
    """Its port (``--master-port``, default 29500), the job's one port: node rank 0's agent
    hosts the job's store there (flexrun's records and, beside them, the workers' keys,
    emptied between rounds), as torchrun's agent hosts its store for its workers."""

    @property
    def store_port(self) -> int:
        """Where node rank 0's agent hosts flexrun's own store: the master port (a static job
        needs no other)."""
        return self.master_port

    def __post_init__(self) -> None:
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(
                f"--node-rank {self.node_rank}: must be 0..{self.nnodes - 1} for --nnodes "
                f"{self.nnodes}"
            )
        if not 0 < self.master_port < 65536:
            raise ConfigError(f"--master-port {self.master_port}: out of range 1-65535")

    @property
    def hosts_store(self) -> bool:
        """Node rank 0 hosts the store at ``master_addr:master_port``."""
        return self.node_rank == 0


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    """Everything ``flexrun run`` needs, validated: this node's identity and mode, and one
    part for each consumer (an agent module is handed its part, not the whole; the recovery
    rules' part is :meth:`flexrun.recovery.RecoverySettings.of` of the rendezvous part)."""

    worker: WorkerSpec
    """What a worker process is and how it is started, watched and stopped."""
    output: OutputSettings = field(default_factory=OutputSettings)
    observe: ObserveSettings = field(default_factory=ObserveSettings)
    spares: SpareSettings = field(default_factory=SpareSettings)
    store: StoreSettings = field(default_factory=StoreSettings)
    rendezvous: RendezvousSettings = field(default_factory=RendezvousSettings)
    static: StaticJob | None = None
    """A fixed-size job (torchrun's static rendezvous); None: elastic or one-host."""
    run_id: str = "default"
    node_id: str = ""
    """Unique id of this agent (host-pid-random by default)."""
    local_addr: str = "127.0.0.1"
    """Address peers use to reach this node's rank-0 worker (MASTER_ADDR). Default: the
    source address of the route toward the rendezvous endpoint (or master) for a multi-host
    job; torchrun's FQDN (when it names this host, else 127.0.0.1) for a one-host job."""
    socket_ifname: str | None = None
    """The interface holding ``local_addr`` on a multi-host job: workers get it as
    ``GLOO_SOCKET_IFNAME`` (and ``NCCL_SOCKET_IFNAME=={name}``) unless the user set those
    (``flexrun.agent.spec.worker_envs``). None: one-host job, or no interface has the address."""
    mode: str = "restart"
    """``restart`` (torchrun semantics) or ``live`` (survivors never restart)."""
    live_shards: int = 1
    """Live mode: workers per replica group (``--live-shards``), consecutive local ranks
    of one node; a failed worker takes its whole group out (sharded models, FSDP2 within a
    group). 1: every worker a whole replica."""
    hang_timeout_s: float = 60.0
    """The least silence after which a rank is hung (its stacks are captured and it is
    treated as failed); the limit is calibrated from the rank's observed steps
    (:mod:`flexrun.agent.progress`). 0: off."""

    def __post_init__(self) -> None:
        if self.mode not in ("restart", "live"):
            raise ConfigError(f"--mode {self.mode!r}: choose live, restart or auto")
        if self.hang_timeout_s < 0:
            raise ConfigError(
                f"--hang-timeout {self.hang_timeout_s:g}: must be 0 (off) or positive"
            )
        if self.live_shards < 1 or self.worker.nproc_per_node % self.live_shards:
            raise ConfigError(
                f"--live-shards {self.live_shards}: must divide --nproc-per-node "
                f"{self.worker.nproc_per_node} (a replica group is on one node)"
            )
        if self.live_shards > 1 and self.mode != "live":
            raise ConfigError(f"--live-shards {self.live_shards}: applies to --mode live only")
        if self.mode == "live" and not backend_named(self.store.backend).live:
            raise ConfigError(
                f"--mode live needs the tcp store (--rdzv-backend c10d); "
                f"{backend_named(self.store.backend).kind} serves restart mode"
            )


def default_node_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


LIVE_API_MARKERS = ("LiveLoop",)


def resolve_mode(mode: str, script: str, *, module: bool) -> str:
    """``auto`` -> ``live`` when the script uses flexrun.train's loop API, else ``restart``."""
    mode = mode.strip().lower()
    if mode != "auto":
        if mode not in ("live", "restart"):
            raise ConfigError(f"--mode {mode!r}: choose live, restart or auto")
        return mode
    if module:
        return "restart"
    try:
        text = Path(script).read_text(errors="replace")
    except OSError:
        return "restart"
    return "live" if any(m in text for m in LIVE_API_MARKERS) else "restart"


def check_dir_arg(path: Path, flag: str) -> Path:
    """``path`` is (or can be made) a directory: nothing on the way is a file.

    Raises:
        ConfigError: ``path`` or one of its parents exists and is not a directory.
    """
    try:
        for p in (path, *path.parents):
            if p.exists():
                if not p.is_dir():
                    what = "names a file" if p == path else f"is below {p}, a file"
                    raise ConfigError(f"{flag} {path}: {what}; give a directory")
                break
    except (OSError, ValueError) as exc:  # a name too long, a NUL byte (the Python API)
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"{flag} {str(path)[:200]!r}: not a usable path ({why})") from exc
    return path


def process_environ() -> Mapping[str, str]:
    """The process environment (the only read of ``os.environ`` in the launcher)."""
    return dict(os.environ)


def run_config_from_args(ns: object, environ: Mapping[str, str]) -> RunConfig:
    """Build and validate a RunConfig from parsed ``flexrun run`` arguments."""
    from flexrun.config.build import build_run_config

    return build_run_config(ns, environ)
