"""Free loopback ports: several asked for at once are distinct and bindable."""

from __future__ import annotations

import socket

import pytest

from flexrun.testing.ports import free_port, free_ports


def test_ports_asked_for_together_are_distinct_and_each_can_be_bound() -> None:
    for _ in range(50):
        ports = free_ports(6)
        assert len(set(ports)) == 6, ports
        with socket.socket() as s:
            s.bind(("127.0.0.1", ports[0]))
    assert 0 < free_port() < 65536


def test_asking_for_no_ports_is_an_error() -> None:
    with pytest.raises(ValueError, match="n >= 1"):
        free_ports(0)
