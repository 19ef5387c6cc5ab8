"""The store backends' registry: one row of traits per backend, the one place that names them.

Owns what the launcher needs to know of a backend without opening it: its
``--rdzv-backend`` names and aliases, whether an agent can host it (tcp) or it is a
server of its own (etcd), its default port, its keep-alive budget (what the default
heartbeat interval and timeout scale with), whether live mode runs on it, whether
restart mode's workers may share the agent's store, and its ``--rdzv-conf`` options
parser. The constructors are :data:`flexrun.store.factory.CONNECTORS` (keyed by
:attr:`Backend.kind`); a new backend is a row here, a constructor there, its module
under ``store/`` and its entry in the store contract suite (``tests/contract``). Nothing
outside ``store/`` and this module compares a backend's name (``tests/test_layers.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from flexrun.config.rdzv_conf import ParsedConf, etcd_options, parse_rdzv_conf, tcp_options
from flexrun.errors import ConfigError

ConfOptions = Callable[[Mapping[str, str], dict[str, str], "float | None", list[str]], None]
"""A backend's ``--rdzv-conf`` options: ``(conf, backend_conf, read_timeout, notes)``
fills ``backend_conf`` (what its constructor receives) and adds info lines to ``notes``."""


@dataclass(frozen=True, slots=True)
class Backend:
    """One store backend's traits."""

    kind: str
    """The constructor's key in :data:`flexrun.store.factory.CONNECTORS`."""
    names: tuple[str, ...]
    """Its ``--rdzv-backend`` names."""
    hosted: bool
    """An agent can host it (standalone, ``is_host``; one ``HOST:PORT``, port 0: pick a
    free one); else it is a server of its own (several endpoints allowed)."""
    default_port: int
    keepalives_per_s: float
    """The keep-alive writes per second its server is budgeted for at the default
    interval (the numbers behind it: :mod:`flexrun.rendezvous.keepalive`)."""
    server_expires: bool
    """The server expires a keep-alive itself (a lease): a renewal every TTL/3 is enough.
    Else readers judge its age and must see renewals: five per timeout."""
    live: bool
    """Live mode runs on it (its workers reach the agent's store by address)."""
    shares_worker_store: bool
    """Restart mode's workers may be clients of a store their agent hosts (torchrun's
    ``TORCHELASTIC_USE_AGENT_STORE``; torchrun's etcd handler does not share its store)."""
    conf_options: ConfOptions

    def keepalive_defaults(self, max_nodes: int) -> tuple[float, float]:
        """(heartbeat_interval_s, heartbeat_timeout_s) by default for up to ``max_nodes``.

        Readers judging the TTL (tcp): max(1 s, N / budget) and five intervals (1 s / 5 s
        up to 2000 nodes). A server that expires leases (etcd, whose own client renews
        every TTL/3): a timeout of max(5, 3N / budget) s rounded up to whole seconds (etcd's
        lease granularity) and a third of it as the interval: 1.67 s / 5 s up to 833 nodes,
        2.33 s / 7 s at 1024, 8.33 s / 25 s at 4096, 20 s / 60 s at 10,000.
        """
        if self.server_expires:
            timeout = float(max(5, math.ceil(3 * max_nodes / self.keepalives_per_s)))
            return timeout / 3, timeout
        interval = max(1.0, max_nodes / self.keepalives_per_s)
        return interval, 5 * interval

    def parse_conf(self, conf: Mapping[str, str], *, max_nodes: int = 1) -> ParsedConf:
        """``--rdzv-conf`` resolved for this backend (:func:`parse_rdzv_conf`).

        Raises:
            ConfigError: a bad value.
        """
        return parse_rdzv_conf(
            conf, keepalive=self.keepalive_defaults(max_nodes), options=self.conf_options
        )


TCP = Backend(
    kind="tcp",
    names=("c10d", "tcp", "static"),
    hosted=True,
    default_port=29400,
    # ~4 requests per keep-alive, 0.1 ms of the tcp server's CPU at 1024 nodes.
    keepalives_per_s=2000.0,
    server_expires=False,
    live=True,
    shares_worker_store=True,
    conf_options=tcp_options,
)
ETCD = Backend(
    kind="etcd",
    names=("etcd", "etcd-v3"),
    hosted=False,
    default_port=2379,
    # Every request through etcd's JSON gateway costs its server 0.3-0.6 ms of CPU,
    # whatever it does (bench/results/rdzv_scale.txt), so 500 keep-alives a second are a
    # quarter of one core.
    keepalives_per_s=500.0,
    server_expires=True,
    live=False,
    shares_worker_store=False,
    conf_options=etcd_options,
)
BACKEND_TABLE: tuple[Backend, ...] = (TCP, ETCD)
"""Every backend, the default (``c10d``) first."""

ALIASES: Mapping[str, tuple[str, str]] = {
    "etcd-v2": (
        "etcd",
        "--rdzv-backend etcd-v2: flexrun talks to etcd through its v3 API (etcd 3.x serves "
        "both); using its etcd backend",
    ),
}
"""torchrun's names flexrun serves with another backend: alias -> (name, note to log)."""

BACKENDS: tuple[str, ...] = tuple(n for b in BACKEND_TABLE for n in b.names)
"""Every ``--rdzv-backend`` name (aliases aside)."""
BACKENDS_TCP = TCP.names
BACKENDS_ETCD = ETCD.names
"""(Kept for callers inside ``store/``; elsewhere a trait of :func:`backend_named` decides.)"""
KEEPALIVES_PER_S = TCP.keepalives_per_s
"""The default backend's keep-alive budget (:mod:`flexrun.rendezvous.keepalive`)."""


def backend_named(name: str) -> Backend:
    """The backend of ``--rdzv-backend`` ``name`` (one of :data:`BACKENDS`).

    Raises:
        ConfigError: no backend has that name.
    """
    for b in BACKEND_TABLE:
        if name in b.names:
            return b
    raise ConfigError(f"--rdzv-backend {name!r} is unknown; choose one of {', '.join(BACKENDS)}")


def keepalive_defaults(max_nodes: int, backend: str = "c10d") -> tuple[float, float]:
    """(heartbeat_interval_s, heartbeat_timeout_s) by default for up to ``max_nodes`` nodes
    on ``backend`` (:meth:`Backend.keepalive_defaults`)."""
    return backend_named(backend).keepalive_defaults(max_nodes)


__all__ = [
    "ALIASES",
    "BACKENDS",
    "BACKENDS_ETCD",
    "BACKENDS_TCP",
    "BACKEND_TABLE",
    "KEEPALIVES_PER_S",
    "Backend",
    "backend_named",
    "keepalive_defaults",
]
