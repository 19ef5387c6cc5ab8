"""Issue 18 point 6: the metrics endpoint listens on 127.0.0.1 unless told otherwise
(``--metrics-host``), as the kernel's own table of listening sockets shows."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from flexrun.observe.metrics import AgentMetrics


def _listening_addrs(port: int) -> set[str]:
    """Local addresses of the TCP (IPv4) sockets listening on ``port`` (/proc/net/tcp)."""
    out = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        addr, p = local.split(":")
        if state == "0A" and int(p, 16) == port:  # 0A: LISTEN
            out.add(socket.inet_ntoa(bytes.fromhex(addr)[::-1]))
    return out


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("host", "expected"), [(None, "127.0.0.1"), ("0.0.0.0", "0.0.0.0")])
def test_metrics_bind_loopback_by_default_and_where_told(host: str | None, expected: str) -> None:
    m = AgentMetrics(0) if host is None else AgentMetrics(0, host=host)
    port = m.start()
    try:
        assert _listening_addrs(port) == {expected}
    finally:
        m.close()
