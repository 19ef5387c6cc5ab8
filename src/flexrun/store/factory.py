"""Open a store client from :class:`flexrun.config.StoreSettings` (never hosts a server).

Owns the backends' constructor table (:data:`CONNECTORS`, keyed by the registry's
:attr:`flexrun.config.backends.Backend.kind`), the one clear error when a backend is not installed,
and authentication: with a job secret every client built here is a
:class:`~flexrun.store.signed.SignedStore`, so no caller has to remember it. Hosting a
tcp store is the agent's business (``flexrun.agent.launch``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from flexrun.config import SECRET_ENV_FILE, StoreSettings, backend_named, read_secret_file
from flexrun.errors import ConfigError, StoreUnavailable
from flexrun.store.api import Store
from flexrun.store.signed import SignedStore


def connect(settings: StoreSettings, endpoint: tuple[str, int] | None = None) -> Store:
    """A client of the configured store (tcp: ``endpoint`` overrides the first endpoint),
    signing and verifying every record when ``settings.secret`` is set.

    Raises:
        StoreUnavailable: the endpoint does not answer within the connect timeout.
        ConfigError: the backend is not available in this installation.
    """
    store = CONNECTORS[backend_named(settings.backend).kind](settings, endpoint)
    return SignedStore(store, settings.secret) if settings.secret is not None else store


def _connect_tcp(settings: StoreSettings, endpoint: tuple[str, int] | None) -> Store:
    if endpoint is None:
        if not settings.endpoints:
            raise ConfigError("no store endpoint given (--rdzv-endpoint HOST:PORT)")
        endpoint = settings.endpoints[0]
    return _tcp(endpoint[0], endpoint[1], settings.connect_timeout_s)


def _connect_etcd(settings: StoreSettings, endpoint: tuple[str, int] | None) -> Store:
    from flexrun.store.etcd import EtcdStore

    return EtcdStore.from_settings(settings)


CONNECTORS: Mapping[str, Callable[[StoreSettings, tuple[str, int] | None], Store]] = {
    "tcp": _connect_tcp,
    "etcd": _connect_etcd,
}
"""Each backend's client (its module imported on use: etcd's only where it is chosen)."""


def connect_from_env(
    host: str, port: int, environ: Mapping[str, str], *, connect_timeout_s: float = 30.0
) -> Store:
    """The tcp store client of a live-mode worker: signed with the job secret that the agent
    passed as ``FLEXRUN_JOB_SECRET_FILE`` (a path, never the value), plain without one.

    Raises:
        StoreUnavailable: the store does not answer within ``connect_timeout_s``.
        ConfigError: the secret file cannot be read.
    """
    store: Store = _tcp(host, port, connect_timeout_s)
    path = environ.get(SECRET_ENV_FILE)
    if path:
        return SignedStore(store, read_secret_file(path))
    return store


def _tcp(host: str, port: int, connect_timeout_s: float) -> Store:
    """A tcp store client, retried until ``connect_timeout_s``: a server that accepts and
    then drops the connection (it is restarting) is waited for like one that refuses.

    Raises:
        StoreUnavailable: not connected within ``connect_timeout_s``.
    """
    from flexrun.store.tcp import TcpStore

    deadline = time.monotonic() + connect_timeout_s
    while True:
        try:
            return TcpStore(host, port, connect_timeout_s=max(0.1, deadline - time.monotonic()))
        except StoreUnavailable:
            if time.monotonic() + 0.2 >= deadline:
                raise
            time.sleep(0.2)


def delete_all_but(store: Store, keep: str) -> int:
    """:func:`flexrun.store.tcp.delete_all_but` through a tcp store client (signed or not);
    0 for other backends (no workers' keys share their server)."""
    from flexrun.store import tcp

    inner = store.inner if isinstance(store, SignedStore) else store
    return tcp.delete_all_but(inner, keep) if isinstance(inner, tcp.TcpStore) else 0


def tcp_address(store: Store) -> tuple[str, int] | None:
    """``(host, port)`` of a tcp store client (signed or not); None for other backends."""
    from flexrun.store.tcp import TcpStore

    inner = store.inner if isinstance(store, SignedStore) else store
    return (inner.host, inner.port) if isinstance(inner, TcpStore) else None
