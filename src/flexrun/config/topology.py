"""The shape of a job from its flags: one host, elastic over a store, or static (fixed N).

Owns torchrun's rules for what ``--standalone``, ``--rdzv-backend``, ``--rdzv-endpoint``,
``--nnodes``, ``--node-rank`` and ``--master-addr/--master-port`` mean together, with
flexrun's documented precedence (docs/user/running.md, "What the flags mean together"):

- ``--standalone``: one host, a store on a free port (torchrun: c10d on ``localhost:0``).
- An endpoint (flag or ``PET_RDZV_ENDPOINT``) with any backend but an explicit ``static``:
  elastic over that store; a static ``--node-rank``/``--master-*`` is ignored (said once).
- torchrun's default backend (``static``) with no endpoint: one host when MAX is 1 and no
  ``--master-port`` is given (torchrun switches to c10d on ``localhost:0`` there), else a
  static job at ``--master-addr:--master-port`` (29500), node rank ``--node-rank``.
- An explicit ``--rdzv-backend static``: a static job (at the endpoint if one is given).
- ``c10d``/``tcp`` without an endpoint: one host on a free port when MAX is 1, else
  torchrun's ``localhost:29400``; ``etcd`` without one: ``localhost:2379``.
- Port 0 (``localhost:0``): a free port on this host, which must host the store.

Pure apart from :func:`flexrun.config.netaddr.is_this_host` (name resolution).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from flexrun.config.backends import backend_named
from flexrun.config.netaddr import is_loopback_literal, is_this_host
from flexrun.config.parsing import parse_endpoint
from flexrun.errors import ConfigError

log = logging.getLogger("flexrun.config")

MASTER_PORT_DEFAULT = 29500


@dataclass(frozen=True, kw_only=True, slots=True)
class Shape:
    """What the flags say about the job's nodes and its store."""

    backend: str
    """The store backend (c10d, tcp, static, etcd, etcd-v3)."""
    endpoints: tuple[tuple[str, int], ...]
    """The store's address(es); () for a store on a free local port."""
    host_store: bool
    min_nodes: int
    max_nodes: int
    static_rank: int | None = None
    """A static job: this node's rank (the store is ``endpoints[0]``)."""
    toward: str | None = None
    """Where the peers are (the store's or master's host) for the address choice; None:
    one-host job."""
    toward_port: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class Given:
    """The topology flags, and which of them the user set (flag or ``PET_*``)."""

    backend: str
    backend_given: bool
    endpoint: str
    standalone: bool
    nnodes: tuple[int, int]
    nnodes_text: str
    node_rank: int
    master_addr: str
    master_port: int | None
    static_given: tuple[str, ...] = ()
    """Names of the static-only options the user set (node-rank, master-addr, master-port)."""
    is_host: bool | None = None


def shape_of(g: Given) -> Shape:
    """Decide the job's shape (rules in the module docstring).

    Raises:
        ConfigError: contradictory flags, a bad endpoint, a port-0 endpoint elsewhere.
    """
    lo, hi = g.nnodes
    if g.standalone:
        if hi != 1:
            raise ConfigError(
                f"--standalone runs one node; drop --nnodes {g.nnodes_text} or --standalone"
            )
        return Shape(backend="c10d", endpoints=(), host_store=True, min_nodes=1, max_nodes=1)
    explicit_static = g.backend == "static" and g.backend_given
    if g.endpoint and not explicit_static:
        if g.static_given:
            log.info(
                "--rdzv-endpoint is given: the rendezvous is elastic over that store; "
                "%s (static rendezvous only) ignored",
                "/".join(f"--{n}" for n in g.static_given),
            )
        backend = "c10d" if g.backend == "static" else g.backend
        return _dynamic(g, backend)
    if g.backend == "static":
        if not g.endpoint and not explicit_static and g.master_port is None and hi == 1:
            return Shape(backend="c10d", endpoints=(), host_store=True, min_nodes=1, max_nodes=1)
        return _static(g)
    return _dynamic(g, g.backend)


def _static(g: Given) -> Shape:
    lo, hi = g.nnodes
    if g.endpoint:
        eps = parse_endpoint(g.endpoint, default_port=0)
        if len(eps) != 1 or eps[0][1] == 0:
            raise ConfigError(
                f"--rdzv-endpoint {g.endpoint!r}: the static backend takes one HOST:PORT "
                "(the master's address)"
            )
        host, port = eps[0]
    else:
        host, port = g.master_addr, g.master_port or MASTER_PORT_DEFAULT
        if not 0 < port < 65536:
            raise ConfigError(f"--master-port {port}: out of range 1-65535")
    if lo != hi:
        log.warning(
            "--nnodes %s with a static rendezvous: the world is fixed at %d nodes (torchrun's "
            "rule); use --rdzv-backend c10d with --rdzv-endpoint for an elastic range",
            g.nnodes_text,
            hi,
        )
    host_store = g.node_rank == 0 if g.is_host is None else g.is_host
    return Shape(
        backend="static",
        endpoints=((host, port),),
        host_store=host_store,
        min_nodes=hi,
        max_nodes=hi,
        static_rank=g.node_rank,
        toward=None if is_loopback_literal(host) else host,
        toward_port=port,
    )


def _dynamic(g: Given, backend: str) -> Shape:
    lo, hi = g.nnodes
    store = backend_named(backend)
    served = not store.hosted  # (a server of its own: etcd)
    if not g.endpoint:
        if served:
            endpoint = f"localhost:{store.default_port}"
        elif hi == 1:
            return Shape(backend=backend, endpoints=(), host_store=True, min_nodes=lo, max_nodes=hi)
        else:
            endpoint = f"localhost:{store.default_port}"
    else:
        endpoint = g.endpoint
    eps = tuple(
        parse_endpoint(endpoint, default_port=store.default_port, allow_port_zero=not served)
    )
    if not eps:
        raise ConfigError(f"--rdzv-endpoint {endpoint!r}: no HOST:PORT in it")
    if not served and len(eps) != 1:
        raise ConfigError(
            f"--rdzv-endpoint {endpoint!r}: the {backend} backend takes one HOST:PORT"
        )
    host, port = eps[0]
    if not served and port == 0:
        if not is_this_host(host):
            raise ConfigError(
                f"--rdzv-endpoint {endpoint!r}: port 0 means a free port on this machine, but "
                f"{host} is another host; give the store's port"
            )
        if hi > 1:
            log.warning(
                "--rdzv-endpoint %s: the store gets a free port here; nodes on other hosts "
                "cannot find it (give a fixed port for a multi-node job)",
                endpoint,
            )
        return Shape(backend=backend, endpoints=(), host_store=True, min_nodes=lo, max_nodes=hi)
    host_store = (not served) and (g.is_host if g.is_host is not None else is_this_host(host))
    return Shape(
        backend=backend,
        endpoints=eps,
        host_store=host_store,
        min_nodes=lo,
        max_nodes=hi,
        toward=None if is_loopback_literal(host) else host,
        toward_port=port,
    )
