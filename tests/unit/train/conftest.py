"""Fixtures of the worker-side unit tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from flexrun.store.tcp import TcpStoreServer


@pytest.fixture
def server() -> Iterator[TcpStoreServer]:
    """A tcp store on loopback, closed after the test."""
    srv = TcpStoreServer("127.0.0.1", 0)
    yield srv
    srv.close()
