"""Which address a node advertises to its peers, and the network interface behind it.

Owns the address decisions of ``flexrun run`` (``--local-addr``'s default, the
``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` default, "is this host the store's host")
and the few look-ups they need (a connected UDP socket's source address, the interface
list, name resolution). It opens no listening socket and sends no packet: ``connect()``
on a UDP socket only asks the kernel for the route.

Why not torchrun's rule (the host name's FQDN): on many hosts the host name resolves to a
loopback address (Debian's ``127.0.1.1``, containers' ``/etc/hosts``), so a node advertises
an address its peers cannot reach, and gloo binds there too: the job hangs after the
rendezvous. The address that reaches the rendezvous endpoint is the one the peers can
reach back (they reach the same store), so that is the default here.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from flexrun.errors import ConfigError

LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})
"""Names that are loopback on every host (so a job whose store is there is single-host)."""
_ANY = ("0.0.0.0", "::", "")
# Documentation addresses (RFC 5737, RFC 3849): routing toward it finds the default route's source
# address; nothing is sent.
_DEFAULT_ROUTE_PROBE = ("198.51.100.1", "2001:db8::1")


def is_loopback_literal(host: str) -> bool:
    """``host`` is loopback on every machine: ``localhost`` or a 127/8 or ::1 address."""
    host = host.strip().strip("[]").lower()
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_loopback_addr(addr: str) -> bool:
    """``addr`` (an address or a name) is, or resolves only to, loopback addresses here."""
    if is_loopback_literal(addr):
        return True
    addrs = resolve(addr)
    return bool(addrs) and all(is_loopback_literal(a) for a in addrs)


def resolve(host: str) -> list[str]:
    """Every address ``host`` resolves to here ([] when it does not resolve)."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return []
    return list(dict.fromkeys(str(info[4][0]).split("%")[0] for info in infos))


def route_source(host: str, port: int = 9) -> str | None:
    """The local address the kernel would use to reach ``host`` (None: no route / no name)."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port or 9, type=socket.SOCK_DGRAM)
    except (OSError, UnicodeError):
        return None
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.connect(sockaddr)
                return str(s.getsockname()[0]).split("%")[0]
        except OSError:
            continue
    return None


def interface_addresses() -> dict[str, list[str]]:
    """Interface name -> its IPv4/IPv6 addresses (psutil; {} where it cannot tell)."""
    try:
        import psutil

        table = psutil.net_if_addrs()
    except (ImportError, OSError):
        return {}
    out: dict[str, list[str]] = {}
    for name, addrs in table.items():
        out[name] = [
            str(a.address).split("%")[0]
            for a in addrs
            if a.family in (socket.AF_INET, socket.AF_INET6)
        ]
    return out


def interface_of(addr: str, table: Mapping[str, Sequence[str]] | None = None) -> str | None:
    """The name of the interface that holds ``addr`` (None: no interface here has it)."""
    table = interface_addresses() if table is None else table
    wanted = set(resolve(addr)) if not _is_ip(addr) else {addr.strip("[]")}
    for name, addrs in table.items():
        if wanted & set(addrs):
            return name
    return None


def local_addresses(table: Mapping[str, Sequence[str]] | None = None) -> set[str]:
    table = interface_addresses() if table is None else table
    return {a for addrs in table.values() for a in addrs}


def is_this_host(host: str) -> bool:
    """True if ``host`` names the local host (as torchrun decides whether to host the store)."""
    host = host.strip("[]")
    if is_loopback_literal(host) or host in _ANY:
        return True
    names = {socket.gethostname(), socket.getfqdn()}
    if host in names:
        return True
    theirs = set(resolve(host))
    mine = local_addresses() | {a for n in names for a in resolve(n)}
    return bool(mine & theirs)


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        return False
    return True


@dataclass(frozen=True, kw_only=True, slots=True)
class Advertised:
    """What this node tells its peers, and the interface behind it."""

    addr: str
    """The address (or name) peers use to reach this node: ``MASTER_ADDR`` when it holds rank 0."""
    ifname: str | None
    """The interface holding ``addr``: the worker default of GLOO_/NCCL_SOCKET_IFNAME for a
    multi-host job (None: single-host job, or no local interface holds ``addr``)."""
    multi_host: bool
    """Peers may be on other hosts (the rendezvous endpoint is not a loopback address)."""


def single_host_addr(fqdn: Callable[[], str] = socket.getfqdn) -> str:
    """torchrun's value (the FQDN) when it names this host, else ``127.0.0.1``."""
    name = fqdn()
    addrs = resolve(name) if name else []
    mine = local_addresses()
    if addrs and all(is_loopback_literal(a) or a in mine for a in addrs):
        return name
    return "127.0.0.1"


def choose_advertised(
    toward: str | None,
    port: int = 0,
    *,
    explicit: str | None = None,
    route: Callable[[str, int], str | None] = route_source,
    table: Mapping[str, Sequence[str]] | None = None,
    single_host: Callable[[], str] = single_host_addr,
) -> Advertised:
    """This node's advertised address for a job whose store (or master) is at ``toward``.

    ``toward`` None or a loopback address: a single-host job (torchrun's FQDN when it names
    this host, else 127.0.0.1). Otherwise the source address of the route toward
    ``toward`` (falling back to the default route's, when that route is a loopback one),
    and the interface holding it. ``explicit`` (``--local-addr``) wins, but a loopback one
    is refused when the store is on another host.

    Raises:
        ConfigError: the only address this node could advertise to peers on other hosts
            is a loopback address.
    """
    multi = toward is not None and not is_loopback_literal(toward)
    table = interface_addresses() if table is None else table
    if explicit:
        if multi and is_loopback_addr(explicit) and toward is not None and not is_this_host(toward):
            raise ConfigError(
                f"--local-addr {explicit}: a loopback address, but the store ({toward}) is on "
                "another host, so peers there cannot reach this node; pass an address they can "
                "reach (or leave --local-addr out: the address of the route to the store is used)"
            )
        ifname = interface_of(explicit, table) if multi else None
        return Advertised(addr=explicit, ifname=ifname, multi_host=multi)
    if not multi:
        return Advertised(addr=single_host(), ifname=None, multi_host=False)
    assert toward is not None
    addr = route(toward, port)
    if addr is None or is_loopback_literal(addr):
        # ``toward`` resolves to this host's loopback alias (a host name mapped to
        # 127.0.1.1 here): peers on other hosts resolve it differently. Use the address of
        # the default route instead.
        for probe in _DEFAULT_ROUTE_PROBE:
            alt = route(probe, 9)
            if alt is not None and not is_loopback_literal(alt):
                addr = alt
                break
    if addr is None:
        raise ConfigError(
            f"no route from this node toward {toward} (the rendezvous endpoint): check the "
            "address, or pass --local-addr with this node's address on the job's network"
        )
    if is_loopback_literal(addr):
        raise ConfigError(
            f"this node would advertise {addr} (a loopback address) to the other nodes of a "
            f"multi-host job (the store is at {toward}): they could not reach it. Pass "
            "--local-addr with an address the other nodes can reach"
        )
    return Advertised(addr=addr, ifname=interface_of(addr, table), multi_host=True)
