"""Hosting torch's C++ ``TCPStore`` server, and reaching one.

Owns where the server listens and the first contact with it; the protocol on top is
:mod:`flexrun.store.tcp`. ``TCPStore``'s own listener binds every interface (its socket
layer listens on a port only), so the server here binds the address it is told itself and
hands the listening socket to ``TCPStore`` (``master_listen_fd``, honoured by both the
libuv and the legacy backend of torch 2.13): ``--host 127.0.0.1`` listens on loopback
only, ``0.0.0.0`` (or ``::``) on every interface. A host that does not resolve is one
:class:`~flexrun.errors.ConfigError` at once, not a retry loop.

A ``TCPStore`` server cannot authenticate its clients: whoever reaches the port can read,
write and delete any key. Records are authenticated by the job's agents instead
(:mod:`flexrun.store.signed`); bind to the narrowest address that the nodes can reach.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

from flexrun._clock import SYSTEM_CLOCK, Clock
from flexrun.errors import ConfigError, StoreUnavailable


def _quiet_cpp_logs() -> None:
    # c10d logs a warning for every expired TCPStore.wait; a bounded wait is normal here.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


def dist() -> Any:
    """``torch.distributed``, imported on first use (the agent starts without torch)."""
    _quiet_cpp_logs()
    import torch.distributed as d

    return d


def probe(host: str, port: int, timeout_s: float, clock: Clock = SYSTEM_CLOCK) -> None:
    """Wait until something accepts TCP connections at ``host:port``.

    Raises:
        StoreUnavailable: nothing accepted within ``timeout_s`` (refused or unreachable).
    """
    deadline = clock.monotonic() + timeout_s
    delay = 0.05
    last: OSError | None = None
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(2.0, timeout_s))):
                return
        except OSError as exc:
            last = exc
        if clock.monotonic() + delay > deadline:
            reason = last.strerror if last is not None and last.strerror else str(last)
            raise StoreUnavailable(
                f"cannot reach the rendezvous store at {host}:{port} ({reason}) after "
                f"{timeout_s:g}s; start one with `flexrun store --host {host} --port {port}` "
                "or check --rdzv-endpoint"
            ) from last
        clock.sleep(delay)
        delay = min(delay * 2, 1.0)


def bind_address(host: str, port: int) -> tuple[socket.AddressFamily, tuple[Any, ...]]:
    """The socket family and address to bind for ``host`` (a name, an IPv4 or IPv6 address).

    Raises:
        ConfigError: the host does not resolve, or the port is out of range.
    """
    if not 0 <= port < 65536:
        raise ConfigError(f"--port {port}: out of range 0-65535")
    try:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except (socket.gaierror, UnicodeError) as exc:
        reason = exc.strerror if isinstance(exc, socket.gaierror) else str(exc)
        raise ConfigError(
            f"--host {host!r}: not an address of this machine or a name that resolves ({reason}); "
            "use 0.0.0.0 for every interface, 127.0.0.1 for this host only, or one of its addresses"
        ) from None
    family, _, _, _, addr = infos[0]
    return socket.AddressFamily(family), addr


class TcpStoreServer:
    """A ``TCPStore`` server in this process, listening on ``host`` only; lives until
    :meth:`close` or process exit.

    Raises (construction):
        ConfigError: ``host`` does not resolve or the port is out of range.
        StoreUnavailable: the address is in use or cannot be bound.
    """

    def __init__(self, host: str = "0.0.0.0", port: int = 0) -> None:
        family, addr = bind_address(host, port)
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and addr[0] in ("::", "::0"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            sock.bind(addr)
            sock.listen(4096)
        except OSError as exc:
            sock.close()
            raise StoreUnavailable(
                f"cannot host a store on {host}:{port}: {exc.strerror or exc}"
            ) from exc
        bound_port = int(sock.getsockname()[1])
        try:
            self._server = dist().TCPStore(
                host,
                bound_port,
                None,
                True,
                timedelta(seconds=30),
                wait_for_workers=False,
                master_listen_fd=sock.fileno(),
            )
        except (RuntimeError, OSError) as exc:
            sock.close()
            raise StoreUnavailable(
                f"cannot host a store on {host}:{port}: {exc}".splitlines()[0]
            ) from exc
        sock.detach()  # the server owns the descriptor now (closing it here would close theirs)
        self.port: int = bound_port
        self.host = host

    def close(self) -> None:
        # TCPStore has no explicit shutdown; dropping the last reference stops the server.
        self._server = None


__all__ = ["TcpStoreServer", "bind_address", "dist", "probe"]
