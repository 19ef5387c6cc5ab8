from __future__ import annotations

import pytest

from flexrun.config import RendezvousSettings, parse_endpoint, parse_kv, parse_nnodes, parse_nproc
from flexrun.errors import ConfigError


def test_nnodes_accepts_n_and_min_max() -> None:
    assert parse_nnodes("2") == (2, 2)
    assert parse_nnodes("1:4") == (1, 4)


@pytest.mark.parametrize("bad", ["4:1", "abc", "0", "0:2", "1:", ":3", "1:2:3", "-1"])
def test_nnodes_rejects_bad_values(bad: str) -> None:
    with pytest.raises(ConfigError, match="--nnodes"):
        parse_nnodes(bad)


def test_nproc_accepts_numbers_and_keywords() -> None:
    assert parse_nproc("3") == 3
    assert parse_nproc("cpu", cpu_count=7) == 7
    assert parse_nproc("auto", cuda_count=0, cpu_count=5) == 5
    assert parse_nproc("auto", cuda_count=2) == 2
    with pytest.raises(ConfigError, match="no CUDA"):
        parse_nproc("gpu", cuda_count=0)
    for bad in ("0", "-2", "x"):
        with pytest.raises(ConfigError):
            parse_nproc(bad)


def test_endpoints_parse_hosts_ports_and_ipv6() -> None:
    assert parse_endpoint("h:1,[::1]:2,k") == [("h", 1), ("::1", 2), ("k", 29400)]
    with pytest.raises(ConfigError):
        parse_endpoint("h:99999")


def test_rdzv_conf_parses_pairs() -> None:
    assert parse_kv("a=1, b = x") == {"a": "1", "b": "x"}
    with pytest.raises(ConfigError):
        parse_kv("novalue")


def test_rendezvous_settings_validate() -> None:
    with pytest.raises(ConfigError):
        RendezvousSettings(min_nodes=2, max_nodes=1)
    with pytest.raises(ConfigError, match="heartbeat_timeout"):
        RendezvousSettings(heartbeat_interval_s=2, heartbeat_timeout_s=1)
