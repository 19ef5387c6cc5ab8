"""One contract, every store backend: memory, tcp and etcd (a real etcd server)."""

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
    assert not ok2 and current is None  # a lost compare-and-set never returns the value
    assert store.get("k").value == b"first"  # type: ignore[union-attr]


def test_compare_and_set_succeeds_only_on_the_current_revision(store: Store) -> None:
    rev = store.put("k", b"v1")
    ok, e = store.compare_and_set("k", b"v2", expected_revision=rev)
    assert ok and e is not None
    stale, current = store.compare_and_set("k", b"v3", expected_revision=rev)
    assert not stale and current is None
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
    # (1 s: etcd's leases count whole seconds; the test server's minimum TTL is 1 s.)
    store.put("hb/a", b"1", ttl_s=1.0)
    store.put("hb/b", b"1", ttl_s=1.0)
    assert set(store.get_prefix("hb/")) == {"hb/a", "hb/b"}
    deadline = time.monotonic() + 4.0
    seen: set[str] = {"hb/a", "hb/b"}
    while time.monotonic() < deadline and "hb/a" in seen:
        store.put("hb/b", b"1", ttl_s=1.0)
        seen = set(store.get_prefix("hb/"))
        assert "hb/b" in seen
        time.sleep(0.1)
    assert seen == {"hb/b"}
    assert store.get("hb/a") is None and store.get("hb/b") is not None


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


def test_compare_and_set_after_a_read_by_another_client_sees_the_current_revision(
    store: Store,
) -> None:
    rev = store.put("cas/k", b"v1")
    store.put("cas/k", b"v2")  # the revision moved on: a CAS on the old one loses
    assert store.compare_and_set("cas/k", b"x", expected_revision=rev) == (False, None)
    cur = store.get("cas/k")
    assert cur is not None
    ok, entry = store.compare_and_set("cas/k", b"v3", expected_revision=cur.revision)
    assert ok and entry is not None and entry.revision > cur.revision
    assert store.get("cas/k").value == b"v3"  # type: ignore[union-attr]


def test_put_many_writes_every_key_and_wakes_watchers(store: Store) -> None:
    since = store.revision()
    items = {f"batch/{i:04d}": f"v{i}".encode() for i in range(700)}  # over one request's worth
    rev = store.put_many(items)
    assert rev >= since + 1 and store.put_many({}) == 0
    got = store.get_prefix("batch/")
    assert {k: e.value for k, e in got.items()} == items
    assert max(e.revision for e in got.values()) == rev
    changed, _ = store.wait_for_change("batch/", since, timeout_s=5)
    assert changed


def test_delete_prefix_removes_only_that_prefix(store: Store) -> None:
    store.put_many({"gone/a": b"1", "gone/b/c": b"2", "gonex": b"3", "kept/a": b"4"})
    assert len(store.get_prefix("gone/")) == 2
    store.delete_prefix("gone/")
    store.delete_prefix("gone/")  # nothing left: not an error
    assert store.get("gone/a") is None and store.get("gone/b/c") is None
    assert store.get_prefix("gone/") == {}
    assert store.get("gonex") is not None and store.get("kept/a") is not None
    ok, _ = store.compare_and_set("gone/a", b"new", expected_revision=0)
    assert ok
    with pytest.raises(ValueError):
        store.delete_prefix("")


def test_a_directory_watch_after_a_read_wakes_on_the_next_write_only(store: Store) -> None:
    """The rendezvous reads (revision first), then waits: the second wait of a watcher
    must still see a write made right after its read, and time out without one."""
    store.wait_for_change("dirw/", store.revision(), timeout_s=0.05)  # (registers the watch)
    since = store.revision()
    assert store.get("dirw/k") is None
    store.put("elsewhere/k", b"0")
    assert not store.wait_for_change("dirw/", since, timeout_s=0.3)[0]
    store.put("dirw/k", b"1")
    assert store.wait_for_change("dirw/", since, timeout_s=5)[0]


def test_get_at_sees_what_get_sees_and_a_watch_from_its_revision_misses_no_later_write(
    store: Store,
) -> None:
    """The optional ``get_at`` (etcd; the signed wrapper on every backend): the entry and a
    revision no older than it, from which a watch sees the next write and nothing before."""
    from flexrun.store.signed import SignedStore

    rev_a = store.put("at/a", b"1")
    for s in (store, SignedStore(store, b"0123456789abcdef0123")):
        get_at = getattr(s, "get_at", None)
        if get_at is None:
            continue
        s.put("at/b", b"2")
        entry, seen = get_at("at/b")
        assert entry is not None and entry.value == b"2" and seen >= entry.revision > rev_a
        absent, seen_absent = get_at("at/none")
        assert absent is None and seen_absent >= seen
        assert s.wait_for_change("at/", seen_absent, 0.2) == (False, seen_absent)
        threading.Timer(0.1, lambda s=s: s.put("at/c", b"3")).start()
        changed, _ = s.wait_for_change("at/", seen_absent, 5.0)
        assert changed


def test_successive_waits_on_one_prefix_see_exactly_the_writes_after_their_revision(
    store: Store,
) -> None:
    """What an agent's one long watch does: wait, read, wait again from the newer revision
    (etcd reads on from the stream the last wait left open): each wait sees a write after
    its revision and nothing at or before it; a wait from an older revision sees the
    writes it missed."""
    r1 = store.put("seq/a", b"1")
    assert store.wait_for_change("seq/", r1 - 1, 5.0)[0]
    r2 = store.put("seq/b", b"2")
    r3 = store.put("seq/c", b"3")
    assert store.wait_for_change("seq/", r2, 5.0)[0]  # c, after b
    assert not store.wait_for_change("seq/", r3, 0.3)[0]  # nothing after c
    threading.Timer(0.1, lambda: store.put("seq/d", b"4")).start()
    changed, _ = store.wait_for_change("seq/", r3, 5.0)
    assert changed
    assert store.wait_for_change("seq/", r1 - 1, 5.0)[0]  # again from before a
    assert store.wait_for_change("seq/", r2, 5.0)[0]  # c and d are after b


def _copying(store: Store) -> list[Store]:
    """``store`` and its signed wrapper, where they have the api's optional value-carrying
    watch (memory and etcd; not tcp, whose change log names keys only)."""
    from flexrun.store.signed import SignedStore

    out = [store, SignedStore(store, b"0123456789abcdef0123")]
    return [s for s in out if callable(getattr(s, "watch_values", None))]


def test_a_copy_kept_from_watch_values_equals_the_prefix_after_writes_deletes_and_a_keep_alive_expiry(
    store: Store,
) -> None:
    """The optional ``get_prefix_at`` + ``watch_values`` (etcd; memory): a copy read once and
    brought up to date from the events equals a fresh read of the prefix after puts,
    overwrites, compare-and-sets, deletes and an expired keep-alive; writes elsewhere
    deliver nothing; a wait with nothing new times out with no events."""
    found = _copying(store)
    if not found:
        pytest.skip("this backend's watches carry no values (the api's optional methods)")
    for i, s in enumerate(found):
        p = f"cp{i}/"
        s.put(p + "a", b"1")
        copy, rev = s.get_prefix_at(p)  # type: ignore[attr-defined]
        assert {k: e.value for k, e in copy.items()} == {p + "a": b"1"}
        assert s.watch_values(p, rev, 0.3) == ([], rev)  # type: ignore[attr-defined]
        s.put("elsewhere/x", b"0")
        s.put(p + "b", b"2")
        s.put(p + "a", b"3")
        ok, _ = s.compare_and_set(p + "c", b"4", expected_revision=0)
        assert ok
        s.delete(p + "b")
        s.put(p + "ttl", b"beat", ttl_s=1)
        deadline = time.monotonic() + 10
        saw_beat = False
        while time.monotonic() < deadline:
            events, new_rev = s.watch_values(p, rev, 1.0)  # type: ignore[attr-defined]
            assert events is not None and new_rev >= rev
            for key, entry in events:
                assert key.startswith(p), key
                if entry is None:
                    copy.pop(key, None)
                else:
                    copy[key] = entry
            rev = new_rev
            saw_beat = saw_beat or p + "ttl" in copy
            if saw_beat and p + "ttl" not in copy:
                break  # the keep-alive came and expired
        assert saw_beat
        now = {k: e.value for k, e in s.get_prefix(p).items()}
        assert {k: e.value for k, e in copy.items()} == now == {p + "a": b"3", p + "c": b"4"}


def test_watch_values_hands_over_every_event_after_its_revision_in_order(store: Store) -> None:
    """Successive waits from the revision each returned (the copy's loop): every write under
    the prefix exactly once, in order, none at or before the revision asked from; one that
    happens while nobody waits is delivered by the next wait."""
    found = _copying(store)
    if not found:
        pytest.skip("this backend's watches carry no values (the api's optional methods)")
    for i, s in enumerate(found):
        p = f"ev{i}/"
        _, rev = s.get_prefix_at(p)  # type: ignore[attr-defined]
        threading.Timer(0.1, lambda s=s, p=p: [s.put(p + "k", str(n).encode()) for n in range(5)]).start()
        seen: list[bytes] = []
        deadline = time.monotonic() + 10
        while len(seen) < 5 and time.monotonic() < deadline:
            events, rev = s.watch_values(p, rev, 2.0)  # type: ignore[attr-defined]
            assert events is not None
            seen += [e.value for _, e in events if e is not None]
        assert seen == [b"0", b"1", b"2", b"3", b"4"]
        s.put(p + "late", b"x")  # while nobody waits
        events, rev2 = s.watch_values(p, rev, 2.0)  # type: ignore[attr-defined]
        assert events is not None and [(k, e.value if e else None) for k, e in events] == [
            (p + "late", b"x")
        ]
        assert rev2 > rev
