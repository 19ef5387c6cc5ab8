"""tcp store: a write whose revision is taken but not yet visible is not missed by a watcher."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from flexrun.errors import StoreUnavailable
from flexrun.store.tcp import TcpStore, TcpStoreServer, _encode
from flexrun.store.tcp_watch import _RECENT, event_key


@pytest.mark.timeout(60)
def test_a_watcher_does_not_skip_a_write_in_flight() -> None:
    server = TcpStoreServer("127.0.0.1", 0)
    writer = TcpStore("127.0.0.1", server.port, connect_timeout_s=5)
    reader = TcpStore("127.0.0.1", server.port, connect_timeout_s=5)
    try:
        writer.put("s/k", b"old")
        # The writer takes its revision ...
        rev = writer._next_rev()
        # ... the reader reads state at that revision (sees the old value) ...
        since = reader.revision()
        assert reader.get("s/k").value == b"old"  # type: ignore[union-attr]

        def land() -> None:
            time.sleep(0.3)
            writer._call(writer._c().set, "s/k", _encode(rev, None, b"new"))
            writer._notify(rev, "s/k")

        t = threading.Thread(target=land)
        t.start()
        changed, _ = reader.wait_for_change("s/", since, timeout_s=5.0)
        t.join()
        assert changed
        assert reader.get("s/k").value == b"new"  # type: ignore[union-attr]
    finally:
        reader.close()
        writer.close()
        server.close()


@pytest.mark.timeout(60)
def test_a_revision_abandoned_by_a_dead_writer_does_not_block_later_changes() -> None:
    server = TcpStoreServer("127.0.0.1", 0)
    store = TcpStore("127.0.0.1", server.port, connect_timeout_s=5)
    try:
        since = store.revision()
        store._next_rev()  # a writer that died before writing
        store.put("s/after", b"1")
        changed, _ = store.wait_for_change("s/", since, timeout_s=10.0)
        assert changed
    finally:
        store.close()
        server.close()


@pytest.mark.timeout(60)
def test_writes_in_another_directory_do_not_wake_a_watcher() -> None:
    """Keep-alives under ``hb/`` must not cost every watcher of ``s/`` a round of reads."""
    server = TcpStoreServer("127.0.0.1", 0)
    writer = TcpStore("127.0.0.1", server.port, connect_timeout_s=5)
    watcher = TcpStore("127.0.0.1", server.port, connect_timeout_s=5)
    calls: list[str] = []
    call = watcher._call

    def counted(fn: object, *args: object) -> object:
        calls.append(getattr(fn, "__name__", "?"))
        return call(fn, *args)

    watcher._call = counted  # type: ignore[method-assign]
    try:
        since = watcher.revision()
        done = threading.Event()

        def beats() -> None:
            for _ in range(40):
                writer.put("job/hb/a", b"1", ttl_s=30)
            writer.put("job/s/nodes/a", b"A")
            done.set()

        t = threading.Thread(target=beats)
        calls.clear()
        t.start()
        changed, _ = watcher.wait_for_change("job/s/", since, timeout_s=20)
        t.join()
        assert done.is_set() and changed
        # Woken once by the write under s/ (a handful of requests), not 40 times.
        assert len(calls) < 40, calls
        # And a keep-alive rings no channel nobody watches: value + event, watched list.
        writer_calls: list[str] = []
        wcall = writer._call

        def wcounted(fn: object, *args: object) -> object:
            writer_calls.append(getattr(fn, "__name__", "?"))
            return wcall(fn, *args)

        writer._call = wcounted  # type: ignore[method-assign]
        writer.put("job/hb/a", b"1", ttl_s=30)
        assert len(writer_calls) <= 3, writer_calls
        writer_calls.clear()
        writer.put("job/s/nodes/b", b"B")  # rings job/s/ (watched), not job/ or job/s/nodes/
        assert writer_calls.count("add") == 2, writer_calls
    finally:
        watcher.close()
        writer.close()
        server.close()


@pytest.mark.timeout(60)
def test_a_restarted_server_does_not_resurrect_keys_from_a_cached_read() -> None:
    server = TcpStoreServer("127.0.0.1", 0)
    port = server.port
    client = TcpStore("127.0.0.1", port, connect_timeout_s=5)
    try:
        client.put("job/nodes/old", b"1")
        assert set(client.get_prefix("job/nodes/")) == {"job/nodes/old"}
        server.close()
        del server
        server = TcpStoreServer("127.0.0.1", port)  # same port, empty: its counter restarts
        deadline = time.monotonic() + 10
        while True:  # the client reconnects on its next call
            try:
                client.put("job/nodes/new", b"2")
                break
            except StoreUnavailable:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        for i in range(5):  # the new server's revision passes the one the cached read was at
            client.put(f"job/other/{i}", b"x")
        assert set(client.get_prefix("job/nodes/")) == {"job/nodes/new"}
    finally:
        client.close()
        server.close()


@pytest.mark.timeout(120)
def test_event_reads_give_up_when_writers_may_prune_the_oldest_under_them() -> None:
    """Seen with 1024 agents: between a reader's check that event keys exist and its
    multi_get, a burst of writes pruned the oldest (EVENT_WINDOW behind), and TCPStore's
    get of the missing key blocked the reader for the op timeout. The read now declines
    (the caller falls back to a full read / reports a change) once the log has moved half
    a window past the oldest key it wants."""
    from flexrun.store.tcp import _EV_PREFIX, EVENT_WINDOW

    server = TcpStoreServer("127.0.0.1", 0)
    writer = TcpStore("127.0.0.1", server.port, connect_timeout_s=5)
    reader = TcpStore("127.0.0.1", server.port, connect_timeout_s=5, op_timeout_s=5)
    try:
        first = writer.put("other/k", b"0")
        names = [f"{_EV_PREFIX}{first}"]
        got = reader._fetch_events(first, names)
        assert got is not None and event_key(bytes(got[0]))[0] == "other/k"
        for i in range(EVENT_WINDOW // 2):
            writer.put("other/k", str(i).encode())
        assert reader._fetch_events(first, names) is None
        # The public reads stay correct: a change under the prefix is reported.
        since = reader.revision()
        writer.put("s/x", b"1")
        assert reader.wait_for_change("s/", since, timeout_s=5.0)[0]
        assert reader.get_prefix("s/")["s/x"].value == b"1"
    finally:
        reader.close()
        writer.close()
        server.close()


@pytest.mark.timeout(60)
def test_a_read_after_a_full_read_sees_a_write_in_flight_during_it_however_old() -> None:
    """A write whose revision was taken before a burst of later writes (older than the
    newest revisions an ordinary revision() searches) and that lands after a full
    get_prefix: the next get_prefix sees it, without waiting for the next full read."""
    server = TcpStoreServer("127.0.0.1", 0)
    writer = TcpStore("127.0.0.1", server.port, connect_timeout_s=5)
    reader = TcpStore("127.0.0.1", server.port, connect_timeout_s=5)
    try:
        writer.put("s/k", b"old")
        rev = writer._next_rev()  # the slow writer takes its revision ...
        for i in range(3 * _RECENT):  # ... others write on meanwhile
            writer.put(f"s/other{i}", b"x")
        first = reader.get_prefix("s/")  # a full read while the write is in flight
        assert first["s/k"].value == b"old"
        writer._call(writer._c().set, "s/k", _encode(rev, None, b"new"))  # it lands
        writer._notify(rev, "s/k")
        writer.put("s/later", b"y")
        again = reader.get_prefix("s/")  # a repeated read: the event log, not a full read
        assert again["s/later"].value == b"y"
        assert again["s/k"].value == b"new"
    finally:
        reader.close()
        writer.close()
        server.close()


@pytest.mark.timeout(60)
def test_repeated_reads_do_not_list_the_servers_keys_again_within_the_full_read_interval() -> None:
    """A watcher reads its prefixes every step: past the first, a read fetches only what
    the event log names (a listing names every key on the server)."""
    server = TcpStoreServer("127.0.0.1", 0)
    store = TcpStore("127.0.0.1", server.port, connect_timeout_s=5)
    listings = []
    inner = store._call

    def counted(fn: Any, *args: Any) -> Any:
        if getattr(fn, "__name__", "") == "list_keys":
            listings.append(time.monotonic())
        return inner(fn, *args)

    store._call = counted  # type: ignore[method-assign]
    try:
        for i in range(50):
            store.put(f"s/k{i % 7}", str(i).encode())
            got = store.get_prefix("s/")
            assert got[f"s/k{i % 7}"].value == str(i).encode()
            time.sleep(0.2)  # 10 s in all: past the old 5 s re-read, within FULL_READ_S
        assert len(listings) == 1, listings
    finally:
        store.close()
        server.close()


@pytest.mark.timeout(60)
def test_a_connect_to_a_server_gone_since_the_probe_gives_up_in_seconds_not_the_op_timeout() -> (
    None
):
    # The race of a static job's survivor: the probe found node rank 0's store, which died
    # before the client's connect. torch retries a refused connect for the whole timeout it is
    # given: with the 30 s operation timeout the survivor's loop stood still for 30 s.
    server = TcpStoreServer("127.0.0.1", 0)
    client = TcpStore("127.0.0.1", server.port, connect_timeout_s=5, op_timeout_s=30)
    try:
        server.close()
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailable, match="cannot connect"):
            client._connect()
        took = time.monotonic() - t0
        assert took < 15, f"a connect to a dead server held the caller {took:.1f}s"
    finally:
        client.close()
