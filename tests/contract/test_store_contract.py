"""One contract, every store backend (memory, tcp; etcd joins when it exists)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from flexrun.store.api import Store
from flexrun.store.memory import MemoryStore
from flexrun.store.tcp import TcpStore, TcpStoreServer


def _memory() -> Iterator[Store]:
    s = MemoryStore()
    yield s
    s.close()


def _tcp() -> Iterator[Store]:
    server = TcpStoreServer("127.0.0.1", 0)
    client = TcpStore("127.0.0.1", server.port, connect_timeout_s=5)
    yield client
    client.close()
    server.close()


def _etcd() -> Iterator[Store]:
    import os
    import tempfile
    from pathlib import Path

    from flexrun.testing.etcd_server import MISSING, EtcdCluster, etcd_binary

    if etcd_binary() is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{MISSING}; CI must run the etcd contract tests")
        pytest.skip(MISSING)
    if os.environ.get("CI") != "true":  # in CI a missing etcd3gw must fail, not skip
        pytest.importorskip(
            "etcd3gw", reason="the etcd extra is not installed (pip install 'flexrun[etcd]')"
        )
    from flexrun.store.etcd import EtcdStore

    with tempfile.TemporaryDirectory() as root, EtcdCluster(Path(root)) as cluster:
        client = EtcdStore(cluster.endpoints, connect_timeout_s=10)
        try:
            yield client
        finally:
            client.close()


BACKENDS = {"memory": _memory, "tcp": _tcp, "etcd": _etcd}


@pytest.fixture(params=sorted(BACKENDS))
def store(request: pytest.FixtureRequest) -> Iterator[Store]:
    yield from BACKENDS[request.param]()


pytestmark = pytest.mark.timeout(60)


def test_get_of_an_absent_key_is_none_without_blocking(store: Store) -> None:
    t0 = time.monotonic()
    assert store.get("nope") is None
    assert time.monotonic() - t0 < 5


def test_put_returns_increasing_revisions_and_get_sees_them(store: Store) -> None:
    r1 = store.put("a", b"1")
    r2 = store.put("b", b"2")
    assert 0 < r1 < r2 <= store.revision()
    assert store.get("a") is not None and store.get("a").value == b"1"  # type: ignore[union-attr]
    assert store.get("b").revision == r2  # type: ignore[union-attr]


def test_compare_and_set_creates_only_when_absent(store: Store) -> None:
    ok, entry = store.compare_and_set("k", b"first", expected_revision=0)
    assert ok and entry is not None and entry.value == b"first"
    ok2, current = store.compare_and_set("k", b"second", expected_revision=0)
    assert not ok2 and current is not None and current.value == b"first"


def test_compare_and_set_succeeds_only_on_the_current_revision(store: Store) -> None:
    rev = store.put("k", b"v1")
    ok, e = store.compare_and_set("k", b"v2", expected_revision=rev)
    assert ok and e is not None
    stale, current = store.compare_and_set("k", b"v3", expected_revision=rev)
    assert not stale and current is not None and current.value == b"v2"
    assert store.get("k").value == b"v2"  # type: ignore[union-attr]


def test_concurrent_compare_and_set_has_exactly_one_winner(store: Store) -> None:
    rev = store.put("round", b"0")
    wins: list[int] = []
    barrier = threading.Barrier(4)

    def contender(i: int) -> None:
        barrier.wait()
        ok, _ = store.compare_and_set("round", str(i).encode(), expected_revision=rev)
        if ok:
            wins.append(i)

    threads = [threading.Thread(target=contender, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(wins) == 1
    assert store.get("round").value == str(wins[0]).encode()  # type: ignore[union-attr]


def test_delete_removes_and_tolerates_absent_keys(store: Store) -> None:
    store.put("p/x", b"1")
    store.delete("p/x")
    store.delete("p/x")
    assert store.get("p/x") is None
    assert store.get_prefix("p/") == {}
    ok, _ = store.compare_and_set("p/x", b"again", expected_revision=0)
    assert ok


def test_get_prefix_returns_only_matching_live_keys(store: Store) -> None:
    store.put("job/nodes/a", b"A")
    store.put("job/nodes/b", b"B")
    store.put("job/other", b"O")
    got = store.get_prefix("job/nodes/")
    assert {k: e.value for k, e in got.items()} == {"job/nodes/a": b"A", "job/nodes/b": b"B"}


def test_a_keep_alive_key_expires_unless_refreshed(store: Store) -> None:
    store.put("hb/a", b"1", ttl_s=0.6)
    store.put("hb/b", b"1", ttl_s=0.6)
    assert set(store.get_prefix("hb/")) == {"hb/a", "hb/b"}
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        store.put("hb/b", b"1", ttl_s=0.6)
        store.get_prefix("hb/")
        time.sleep(0.1)
    assert set(store.get_prefix("hb/")) == {"hb/b"}


def test_wait_for_change_wakes_on_a_write_under_the_prefix_only(store: Store) -> None:
    since = store.revision()

    def writer() -> None:
        time.sleep(0.2)
        store.put("elsewhere/x", b"1")
        time.sleep(0.2)
        store.put("watched/x", b"1")

    t = threading.Thread(target=writer)
    t.start()
    t0 = time.monotonic()
    changed, rev = store.wait_for_change("watched/", since, timeout_s=10)
    elapsed = time.monotonic() - t0
    t.join()
    assert changed and rev >= since + 2
    assert elapsed < 9


def test_wait_for_change_times_out_without_a_change(store: Store) -> None:
    since = store.revision()
    changed, rev = store.wait_for_change("quiet/", since, timeout_s=0.3)
    assert not changed and rev >= since


def test_wait_for_change_sees_a_write_that_happened_before_the_call(store: Store) -> None:
    since = store.revision()
    store.put("watched/y", b"1")
    changed, _ = store.wait_for_change("watched/", since, timeout_s=5)
    assert changed


def test_repeated_get_prefix_sees_every_write_and_delete_since_the_last(store: Store) -> None:
    store.put("job/nodes/a", b"A")
    store.put("job/nodes/b", b"B")
    assert set(store.get_prefix("job/nodes/")) == {"job/nodes/a", "job/nodes/b"}
    store.put("job/nodes/c", b"C")
    store.put("job/nodes/a", b"A2")
    store.put("job/elsewhere", b"E")
    got = store.get_prefix("job/nodes/")
    assert {k: e.value for k, e in got.items()} == {
        "job/nodes/a": b"A2",
        "job/nodes/b": b"B",
        "job/nodes/c": b"C",
    }
    assert got["job/nodes/a"].revision == store.get("job/nodes/a").revision  # type: ignore[union-attr]
    store.delete("job/nodes/b")
    assert set(store.get_prefix("job/nodes/")) == {"job/nodes/a", "job/nodes/c"}
    store.delete("job/nodes/a")
    store.put("job/nodes/d", b"D")  # a delete and a create between two reads
    assert set(store.get_prefix("job/nodes/")) == {"job/nodes/c", "job/nodes/d"}
    store.put("job/nodes/b", b"B2")  # re-created
    assert store.get_prefix("job/nodes/")["job/nodes/b"].value == b"B2"


def test_a_keep_alive_key_reads_back_exactly_what_was_written(store: Store) -> None:
    store.put("hb/a", b"payload\n with a newline", ttl_s=30)
    assert store.get("hb/a").value == b"payload\n with a newline"  # type: ignore[union-attr]
    assert store.get_prefix("hb/")["hb/a"].value == b"payload\n with a newline"


@pytest.mark.parametrize("key", ["watched/deeper/x", "watched/ep"])
def test_wait_for_change_wakes_on_a_write_in_a_subdirectory_or_a_partial_name(
    store: Store, key: str
) -> None:
    prefix, decoy = ("watched/", "elsewhere/x") if "deeper" in key else ("watched/e", "watched/o")
    since = store.revision()

    def writer() -> None:
        time.sleep(0.3)
        store.put(decoy, b"1")  # not under the prefix: must not count as the change
        store.put(key, b"1")

    t = threading.Thread(target=writer)
    t.start()
    changed, _ = store.wait_for_change(prefix, since, timeout_s=20)
    t.join()
    assert changed
    assert store.get(key) is not None
