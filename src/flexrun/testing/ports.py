"""Free loopback TCP ports for tests and benches.

Owns asking the kernel for ports nobody listens on. Several ports asked for at once are
distinct: every socket stays bound until the last is picked (the kernel may hand a port
it just gave out to the very next ``bind(0)``; CI once got the same port for an etcd
member's client and peer URLs). A port can still be taken by another process between
the pick and its use; callers that start a server retry with new ports on
"address already in use" (``EtcdCluster.start``).
"""

from __future__ import annotations

import contextlib
import socket


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports on ``host`` that were free a moment ago."""
    if n < 1:
        raise ValueError(f"free_ports needs n >= 1, got {n}")
    with contextlib.ExitStack() as held:
        ports = []
        for _ in range(n):
            s = held.enter_context(socket.socket())
            s.bind((host, 0))
            ports.append(int(s.getsockname()[1]))
        return ports


def free_port(host: str = "127.0.0.1") -> int:
    """One port on ``host`` that was free a moment ago."""
    return free_ports(1, host)[0]


__all__ = ["free_port", "free_ports"]
