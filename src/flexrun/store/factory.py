"""Open a store client from :class:`flexrun.config.StoreSettings` (never hosts a server).

Owns the choice of backend class and the one clear error when a backend is not installed.
Hosting a tcp store is the agent's business (``flexrun.agent.launch``).
"""

from __future__ import annotations

from flexrun.config import BACKENDS_ETCD, StoreSettings
from flexrun.errors import ConfigError
from flexrun.store.api import Store


def connect(settings: StoreSettings, endpoint: tuple[str, int] | None = None) -> Store:
    """A client of the configured store (tcp: ``endpoint`` overrides the first endpoint).

    Raises:
        StoreUnavailable: the endpoint does not answer within the connect timeout.
        ConfigError: the backend is not available in this installation.
    """
    if settings.backend in BACKENDS_ETCD:
        try:
            from flexrun.store.etcd import EtcdStore
        except ImportError as exc:
            raise ConfigError(
                f"--rdzv-backend {settings.backend}: the etcd backend is not available in this "
                "installation (pip install 'flexrun[etcd]')"
            ) from exc
        return EtcdStore.from_settings(settings)
    from flexrun.store.tcp import TcpStore

    if endpoint is None:
        if not settings.endpoints:
            raise ConfigError("no store endpoint given (--rdzv-endpoint HOST:PORT)")
        endpoint = settings.endpoints[0]
    return TcpStore(endpoint[0], endpoint[1], connect_timeout_s=settings.connect_timeout_s)
