"""tcp store: the full reads of several prefixes share one listing of the server's keys, and
the event log's name of a revision is fetched once however many prefixes catch up over it;
what each read returns stays exact (a key written between two prefixes' reads, a delete)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from flexrun.store.tcp import _EV_PREFIX, TcpStore, TcpStoreServer


@pytest.fixture
def store() -> Iterator[TcpStore]:
    server = TcpStoreServer("127.0.0.1", 0)
    client = TcpStore("127.0.0.1", server.port, connect_timeout_s=5)
    try:
        yield client
    finally:
        client.close()
        server.close()


class Calls:
    """The requests one client sends: how many of each kind, and the key names each kind sent."""

    def __init__(self, store: TcpStore) -> None:
        self.kinds: Counter[str] = Counter()
        self.names: Counter[tuple[str, str]] = Counter()
        inner = store._call

        def counted(fn: Any, *args: Any) -> Any:
            kind = getattr(fn, "__name__", "?")
            self.kinds[kind] += 1
            if args and isinstance(args[0], list):
                self.names.update((kind, n) for n in args[0] if isinstance(n, str))
            return inner(fn, *args)

        store._call = counted  # type: ignore[method-assign]

    def clear(self) -> None:
        self.kinds.clear()
        self.names.clear()


def _values(got: dict[str, Any]) -> dict[str, bytes]:
    return {k: e.value for k, e in got.items()}


@pytest.mark.timeout(60)
def test_full_reads_of_three_prefixes_share_one_listing(store: TcpStore) -> None:
    store.put_many({f"job/nodes/{i}": b"n" for i in range(20)})
    store.put_many({f"job/hb/{i}": b"b" for i in range(20)})
    calls = Calls(store)
    store.get_prefix("job/nodes/")
    store.put("job/hb/late", b"b")  # written between the first prefix's listing and the next
    hb = store.get_prefix("job/hb/")
    asks = store.get_prefix("job/ask/")
    assert calls.kinds["list_keys"] == 1
    assert set(hb) == {f"job/hb/{i}" for i in range(20)} | {"job/hb/late"}
    assert asks == {}


@pytest.mark.timeout(60)
def test_each_revisions_event_is_fetched_once_across_prefixes(store: TcpStore) -> None:
    prefixes = ("job/nodes/", "job/hb/", "job/ask/")
    for p in prefixes:
        store.get_prefix(p)
    revs = [store.put(f"job/hb/{i}", b"b") for i in range(10)]
    store.put("job/nodes/x", b"n")
    store.delete("job/hb/3")
    calls = Calls(store)
    got = {p: store.get_prefix(p) for p in prefixes}
    for rev in revs:
        assert calls.names["multi_get", f"{_EV_PREFIX}{rev}"] == 1  # by the first prefix only
        assert calls.names["check", f"{_EV_PREFIX}{rev}"] == 2  # landed? logged? (once each)
    assert set(got["job/nodes/"]) == {"job/nodes/x"}
    assert set(got["job/hb/"]) == {f"job/hb/{i}" for i in range(10) if i != 3}
    assert got["job/ask/"] == {}
    assert calls.kinds["list_keys"] == 0


@pytest.mark.timeout(60)
def test_a_shared_listing_forgets_keys_a_delete_prefix_removed(store: TcpStore) -> None:
    store.put_many({"job/r/a/0": b"x", "job/r/a/1": b"y", "job/nodes/n": b"n"})
    assert set(store.get_prefix("job/nodes/")) == {"job/nodes/n"}
    store.delete_prefix("job/r/a/")
    # (a listing naming the removed keys would block on their values until the op timeout)
    assert store.get_prefix("job/r/") == {}
    assert _values(store.get_prefix("job/nodes/")) == {"job/nodes/n": b"n"}


@pytest.mark.timeout(60)
def test_a_key_rewritten_unchanged_is_taken_from_the_event_log_a_changed_one_is_read() -> None:
    """A keep-alive renewed with the same value and TTL: a reader that has the value
    rebuilds it at its new revision from the event's digest, without reading it; a
    changed value, TTL or a delete is read (and a reader new to the key reads it)."""
    server = TcpStoreServer("127.0.0.1", 0)
    writer = TcpStore("127.0.0.1", server.port, connect_timeout_s=5)
    reader = TcpStore("127.0.0.1", server.port, connect_timeout_s=5)
    try:
        for i in range(4):
            writer.put(f"job/hb/{i}", b"record", ttl_s=5)
        first = reader.get_prefix("job/hb/")
        calls = Calls(reader)
        renewed = writer.put("job/hb/0", b"record", ttl_s=5)
        writer.put("job/hb/1", b"other record", ttl_s=5)
        writer.put("job/hb/2", b"record", ttl_s=9)
        writer.delete("job/hb/3")
        writer.put("job/hb/new", b"record", ttl_s=5)
        got = reader.get_prefix("job/hb/")
        read = {n for (kind, n) in calls.names if kind == "multi_get" and n.startswith("job/")}
        assert read == {"job/hb/1", "job/hb/2", "job/hb/3", "job/hb/new"}
        assert got["job/hb/0"].value == b"record"
        assert got["job/hb/0"].revision == renewed > first["job/hb/0"].revision
        assert got["job/hb/1"].value == b"other record"
        assert set(got) == {"job/hb/0", "job/hb/1", "job/hb/2", "job/hb/new"}
        assert reader.get("job/hb/0") == got["job/hb/0"]  # (what a plain read returns)
    finally:
        reader.close()
        writer.close()
        server.close()


@pytest.mark.timeout(60)
def test_a_value_kept_newer_than_the_event_caught_up_over_is_not_rebuilt_older(
    store: TcpStore,
) -> None:
    """A full read is not atomic: it may hold a key's value from after the revision it is
    taken at. Catching up over an older rewrite of the same value keeps the newer one."""
    first = store.put("job/hb/a", b"record", ttl_s=5)
    second = store.put("job/hb/a", b"record", ttl_s=5)
    newer = store._raw("job/hb/a")
    assert newer is not None and newer.startswith(f"{second} ".encode())
    epoch = bytes(store._call(store._c().compare_set, "__flexrun/epoch", b"", b"e1"))
    got = store._reads._catch_up("job/hb/", (epoch, first - 1, {"job/hb/a": newer}), first)
    assert got == {"job/hb/a": newer}
