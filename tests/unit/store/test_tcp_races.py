"""tcp store: a write whose revision is taken but not yet visible is not missed by a watcher."""

from __future__ import annotations

import threading
import time

import pytest

from flexrun.store.tcp import TcpStore, TcpStoreServer, _encode


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
