"""The tcp store server listens where it is told, and an address that does not resolve is
one clear line at once (it took 38 s and 22 lines)."""

from __future__ import annotations

import time

import psutil
import pytest

from flexrun.errors import ConfigError
from flexrun.store.tcp import TcpStore, TcpStoreServer


def _listening(port: int) -> set[str]:
    return {
        c.laddr.ip
        for c in psutil.net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
    }


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("host", "expected"), [("127.0.0.1", {"127.0.0.1"}), ("0.0.0.0", {"0.0.0.0"})]
)
def test_the_server_binds_the_address_it_is_told(host: str, expected: set[str]) -> None:
    server = TcpStoreServer(host, 0)
    try:
        assert _listening(server.port) == expected
        client = TcpStore("127.0.0.1", server.port, connect_timeout_s=5)
        client.put("k", b"v")
        assert client.get("k").value == b"v"  # type: ignore[union-attr]
        client.close()
    finally:
        server.close()


@pytest.mark.timeout(30)
def test_an_unresolvable_host_is_one_config_error_at_once() -> None:
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as err:
        TcpStoreServer("999.1.1.1", 0)
    assert time.monotonic() - t0 < 10
    assert "999.1.1.1" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="out of range"):
        TcpStoreServer("127.0.0.1", 70000)


@pytest.mark.timeout(30)
def test_flexrun_store_with_an_unresolvable_host_exits_2_with_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from flexrun.cli import main

    assert main(["store", "--host", "999.1.1.1", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "999.1.1.1" in err[0]
