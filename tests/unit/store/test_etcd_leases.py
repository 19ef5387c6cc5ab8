"""EtcdStore's keep-alive keys against etcd's lease rules (a gateway fake: grant, keep-alive,
put, expiry by a fake clock): a put attached to a lease does not renew it."""

from __future__ import annotations

import base64
import threading
from typing import Any

import pytest

from flexrun.errors import StoreError
from flexrun.store.etcd import EtcdStore
from flexrun.testing import FakeClock


class LeaseGateway:
    """What etcd's JSON gateway does with leases, as far as a keep-alive key goes."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.leases: dict[int, list[float]] = {}  # id -> [ttl, expires at]
        self.kv: dict[str, int] = {}  # key -> lease
        self.rev = 0
        self.next_id = 1
        self.expired: list[tuple[int, float]] = []
        self.calls: list[str] = []

    def _expire(self) -> None:
        now = self.clock.monotonic()
        for lease, (_, until) in list(self.leases.items()):
            if now >= until:
                del self.leases[lease]
                self.expired.append((lease, now))
                self.kv = {k: v for k, v in self.kv.items() if v != lease}

    def call(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        self._expire()
        self.calls.append(path)
        now = self.clock.monotonic()
        if path == "/lease/grant":
            lease, self.next_id = self.next_id, self.next_id + 1
            self.leases[lease] = [float(payload["TTL"]), now + payload["TTL"]]
            return {"ID": str(lease), "TTL": str(payload["TTL"])}
        if path == "/lease/keepalive":
            lease = int(payload["ID"])
            if lease not in self.leases:
                return {"result": {"ID": str(lease)}}
            self.leases[lease][1] = now + self.leases[lease][0]
            return {"result": {"ID": str(lease), "TTL": str(int(self.leases[lease][0]))}}
        if path == "/kv/put":
            lease = int(payload.get("lease", 0))
            if lease and lease not in self.leases:
                raise StoreError("etcd at fake: etcdserver: requested lease not found")
            self.rev += 1
            self.kv[base64.b64decode(payload["key"]).decode()] = lease  # no renewal
            return {"header": {"revision": str(self.rev)}}
        raise AssertionError(path)


def _store(gateway: LeaseGateway, clock: FakeClock) -> EtcdStore:
    store = object.__new__(EtcdStore)  # the gateway stands in for the connected cluster
    store._cluster = gateway  # type: ignore[assignment]
    store._clock = clock
    store._lock = threading.Lock()
    store._leases = {}
    store._snapshots = {}
    return store


@pytest.mark.parametrize("late_s", [0.0, 2.5, 4.5])
def test_a_keepalive_key_lives_while_beats_are_less_than_its_ttl_apart(late_s: float) -> None:
    """Beats every TTL/3 (the etcd default), one of them late: the key survives whenever
    no two beats are a TTL apart, the beat that rewrites the value included."""
    clock = FakeClock()
    gw = LeaseGateway(clock)
    store = _store(gw, clock)
    ttl, interval = 7.0, 7.0 / 3
    store.put("hb/n1", b"rec", ttl_s=ttl)
    for k in range(1, 40):
        clock.advance(interval + (late_s if k % 3 == 1 else 0.0))
        store.put("hb/n1", b"rec", ttl_s=ttl)
        gw._expire()
        assert gw.expired == [], f"lease expired at beat {k}"
        assert "hb/n1" in gw.kv
    assert gw.calls.count("/lease/grant") == 1  # one lease for the key's whole life


def test_a_key_whose_lease_expired_comes_back_on_a_new_lease_at_the_next_beat() -> None:
    clock = FakeClock()
    gw = LeaseGateway(clock)
    store = _store(gw, clock)
    store.put("hb/n1", b"rec", ttl_s=5.0)
    clock.advance(6.0)  # the store was unreachable longer than the TTL
    gw._expire()
    assert "hb/n1" not in gw.kv
    store.put("hb/n1", b"rec", ttl_s=5.0)
    assert "hb/n1" in gw.kv and gw.calls.count("/lease/grant") == 2
    assert gw.calls[-1] == "/kv/put"
