"""live_settle.GroupJoins on a real store: the members of a replica group go on from an
epoch's join together or not at all, whichever epochs each of them tried."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from members_support import run_members

from flexrun.errors import FlexrunError, LiveAborted
from flexrun.live_protocol import LiveEnv
from flexrun.store.tcp import TcpStoreServer
from flexrun.train.live_group import EpochGroup
from flexrun.train.live_settle import GroupJoins, _went_on

pytestmark = pytest.mark.timeout(60)


def _joins(port: int, shard: int, tmp: Path, timeout_s: float = 20.0) -> GroupJoins:
    env = LiveEnv(
        store_host="127.0.0.1",
        store_port=port,
        run_id="unit",
        worker_id=f"w{shard}",
        heartbeat_file=tmp / f"w{shard}.hb",
        heartbeat_interval_s=0.5,
        run_dir=None,
        round=0,
        shards=2,
        group="n0.g0.1",
        shard=shard,
    )
    return GroupJoins(EpochGroup(env, timeout_s=timeout_s), env)


def _pair(port: int, tmp: Path, a_timeout_s: float = 20.0) -> tuple[GroupJoins, GroupJoins]:
    """Shards 0 and 1 of one group, both trying epoch 5."""
    a, b = _joins(port, 0, tmp, timeout_s=a_timeout_s), _joins(port, 1, tmp)
    a.tried(5)
    b.tried(5)
    return a, b


def _both(a: Callable[[], Any], b: Callable[[], Any]) -> list[Any]:
    return run_members([a, b], timeout_s=30)


@pytest.mark.parametrize(
    ("record", "verdict"),
    [
        (None, None),  # never reached any join
        (b"4 ok 3", None),  # an older epoch: not there yet
        (b"5 try 3", None),  # still trying it
        (b"5 ok 3", True),
        (b"5 fail 3", False),
        (b"6 try 5", True),  # went on from 5 and is already trying 6
        (b"6 try 3", False),  # tried 6 without going on from 5 (failed or skipped it)
        (b"6 fail 3", False),
    ],
)
def test_a_mates_record_reads_as_its_verdict_on_the_epoch(
    record: bytes | None, verdict: bool | None
) -> None:
    assert _went_on(record, 5) is verdict


@pytest.mark.parametrize("junk", [b"", b"5 ok", b"5 maybe 3", b"x ok 3", b"\xff\xfe 1 2"])
def test_a_record_that_is_not_one_is_refused(junk: bytes) -> None:
    with pytest.raises(ValueError):
        _went_on(junk, 5)


def test_a_completed_join_waits_for_the_late_mate_and_both_go_on(
    server: TcpStoreServer, tmp_path: Path
) -> None:
    a, b = _pair(server.port, tmp_path)

    def late_b() -> float:
        time.sleep(0.5)
        b.settle(5)
        return time.monotonic()

    t0 = time.monotonic()
    got = _both(lambda: (a.settle(5), time.monotonic())[1], late_b)
    assert all(isinstance(t, float) for t in got), got
    assert got[0] - t0 >= 0.4, "the first member did not wait for its mate"
    assert a.went_on == b.went_on == 5


def test_a_mate_whose_join_failed_holds_the_other_back_then_both_go_on_from_the_next(
    server: TcpStoreServer, tmp_path: Path
) -> None:
    """The asymmetry it exists for: member a saw epoch 5's last vote complete, member b,
    still waiting for it, saw an aborting epoch and failed 5. Neither goes on from 5;
    both go on from 6."""
    a, b = _pair(server.port, tmp_path)

    def b_fails() -> None:
        time.sleep(0.3)
        b.failed(5)

    got = _both(lambda: a.settle(5), b_fails)
    assert isinstance(got[0], LiveAborted) and "epoch 5" in str(got[0]), got
    a.failed(5)
    a.tried(6)
    b.tried(6)
    assert _both(lambda: a.settle(6), lambda: b.settle(6)) == [None, None]
    assert a.went_on == b.went_on == 6


def test_a_mate_that_skipped_the_epoch_holds_the_other_back(
    server: TcpStoreServer, tmp_path: Path
) -> None:
    """b never saw epoch 5 (6 was published before it looked): a must not go on from 5
    alone, and must not wait for b's verdict on it (b needs a in epoch 6)."""
    a, b = _joins(server.port, 0, tmp_path), _joins(server.port, 1, tmp_path)
    a.tried(5)
    got = _both(lambda: a.settle(5), lambda: (time.sleep(0.3), b.tried(6)))
    assert isinstance(got[0], LiveAborted), got


def test_a_mate_that_went_on_and_moved_to_the_next_epoch_still_counts_as_gone_on(
    server: TcpStoreServer, tmp_path: Path
) -> None:
    a, b = _pair(server.port, tmp_path)
    assert _both(lambda: a.settle(5), lambda: (b.settle(5), b.tried(6))) == [None, (None, None)]
    # a later reader of b's record (6 try, went on from 5) reads 5 as completed
    a2 = _joins(server.port, 0, tmp_path)
    a2.tried(5)
    a2.settle(5)
    assert a2.went_on == 5


def test_a_mate_that_gives_no_verdict_ends_the_worker_after_twice_the_timeout(
    server: TcpStoreServer, tmp_path: Path
) -> None:
    a, b = _pair(server.port, tmp_path, a_timeout_s=0.5)  # (b never finishes: a frozen mate)
    t0 = time.monotonic()
    with pytest.raises(FlexrunError, match="replaces replica group n0.g0.1"):
        a.settle(5)
    assert 0.9 <= time.monotonic() - t0 < 10
    assert a.went_on == -1


def test_a_strangers_junk_at_a_mates_record_is_waited_past(
    server: TcpStoreServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    a, b = _joins(server.port, 0, tmp_path), _joins(server.port, 1, tmp_path)
    a.tried(5)
    a.group.store.put(f"{a.group.keys.root}joins/n0.g0.1/1", b"\x00junk")

    def b_later() -> None:
        time.sleep(0.4)
        b.tried(5)
        b.settle(5)

    with caplog.at_level(logging.WARNING, logger="flexrun.train.live_settle"):
        assert _both(lambda: a.settle(5), b_later) == [None, None]
    assert sum("unreadable join record" in r.message for r in caplog.records) == 1


def test_members_waiting_when_the_store_restarts_post_their_records_again(
    tmp_path: Path,
) -> None:
    """A restarted store has lost every record: both mates, still waiting for each other's
    verdict, post theirs again and go on together (not the bound, then a replacement)."""
    from flexrun.store.tcp import TcpStoreServer

    srv = TcpStoreServer("127.0.0.1", 0)
    port = srv.port
    try:
        a, b = _pair(port, tmp_path)

        def b_after_the_restart() -> float:
            nonlocal srv
            time.sleep(0.3)  # (a posted "5 ok" and waits for b)
            srv.close()
            srv = TcpStoreServer("127.0.0.1", port)  # (empty: a's record is gone)
            time.sleep(0.3)
            b.settle(5)
            return time.monotonic()

        t0 = time.monotonic()
        got = _both(lambda: (a.settle(5), time.monotonic())[1], b_after_the_restart)
        assert all(isinstance(t, float) for t in got), got
        assert max(got) - t0 < 10, "the members waited out the bound"
        assert a.went_on == b.went_on == 5
    finally:
        srv.close()
