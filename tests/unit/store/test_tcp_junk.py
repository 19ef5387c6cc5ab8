"""Junk on the tcp store (issue 33): a stranger's bytes under a key stand for the last value
read there, a counter the server cannot add to is reset once, and reports are rate-limited."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from junk_support import TcpJunk

from flexrun.store.rejects import Rejects
from flexrun.store.tcp import TcpStore, TcpStoreServer
from flexrun.store.tcp_junk import decode
from flexrun.testing import FakeClock

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def pair() -> Iterator[tuple[TcpStore, TcpJunk]]:
    server = TcpStoreServer("127.0.0.1", 0)
    client = TcpStore("127.0.0.1", server.port, connect_timeout_s=5, op_timeout_s=5)
    yield client, TcpJunk("127.0.0.1", server.port)
    client.close()
    server.close()


@pytest.mark.parametrize(
    "raw",
    [b"", b"abc", b"\xff\xfe", b"12", b"12 -", b"0 -\nx", b"-1 -\nx", b"1 nan\nx", b"1 \xff\nx",
     b"99999999999999999999 -\nx", b"1 x\nleft over", b"\xd9\xa1 -\nx"],  # fmt: skip
)
def test_bytes_outside_the_encoding_do_not_decode(raw: bytes) -> None:
    assert decode(raw) is None


def test_junk_over_a_key_stands_for_the_last_value_and_a_compare_and_set_replaces_it(
    pair: tuple[TcpStore, TcpJunk],
) -> None:
    client, raw = pair
    reports: list[tuple[str, str]] = []
    client.rejects.add_sink(lambda k, why: reports.append((k, why)))
    rev = client.put("job/k", b"good")
    assert client.get("job/k").value == b"good"  # type: ignore[union-attr]
    raw.put("job/k", b"\xff garbage")
    entry = client.get("job/k")
    assert entry is not None and (entry.value, entry.revision) == (b"good", rev)
    assert client.get_prefix("job/") == {"job/k": entry}
    ok, new = client.compare_and_set("job/k", b"newer", expected_revision=rev)
    assert ok and new is not None and client.get("job/k").value == b"newer"  # type: ignore[union-attr]
    raw.put("job/fresh", b"junk")  # never read good: absent, and creatable
    assert client.get("job/fresh") is None
    assert client.compare_and_set("job/fresh", b"mine", expected_revision=0)[0]
    assert reports and reports[0] == ("job/k", "not a flexrun record")


def test_a_revision_counter_that_is_not_a_number_is_reset_above_the_log(
    pair: tuple[TcpStore, TcpJunk],
) -> None:
    client, raw = pair
    before = client.put("job/a", b"1")
    raw.put("__flexrun/rev", b"abc")
    after = client.put("job/b", b"2")
    assert after > before
    assert client.revision() >= after
    assert client.get("job/b").revision == after  # type: ignore[union-attr]
    assert raw.get("__flexrun/rev") == str(after).encode()


def test_a_change_log_entry_that_is_not_text_reads_everything_again(
    pair: tuple[TcpStore, TcpJunk],
) -> None:
    client, raw = pair
    client.put("job/a", b"1")
    assert set(client.get_prefix("job/")) == {"job/a"}
    rev = client.put("job/b", b"2")
    raw.put(f"__flexrun/ev/{rev}", b"\xff\xfe")
    assert set(client.get_prefix("job/")) == {"job/a", "job/b"}
    changed, _ = client.wait_for_change("job/", rev - 1, 0.5)
    assert changed


def test_reports_are_rate_limited_per_key_and_overall() -> None:
    clock = FakeClock()
    got: list[tuple[str, str]] = []
    rejects = Rejects(every_s=60, burst=3, sink=lambda k, why: got.append((k, why)), clock=clock)
    for _ in range(5):
        rejects.report("k", "junk")
    assert got == [("k", "junk")]
    for i in range(10):
        rejects.report(f"k{i}", "junk")
    assert len(got) == 3 and rejects.count == 15
    clock.advance(61)
    rejects.report("k", "junk")
    assert len(got) == 4


def test_a_key_that_is_not_utf8_is_deleted_not_a_failed_listing(
    pair: tuple[TcpStore, TcpJunk],
) -> None:
    client, raw = pair
    client.put("job/a", b"1")
    raw.put(b"job/\xff\xfe", b"x")
    assert set(client.get_prefix("job/")) == {"job/a"}
    assert [k for k in raw.keys("job/") if "\ufffd" in k] == []  # (deleted)
    client.delete_prefix("job/")
    assert client.get_prefix("job/") == {}
