"""A hostile client against the signing store: forged, truncated, oversized, moved and
replayed records are ignored (and reported once), and none of them can block a writer."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from flexrun.store.memory import MemoryStore
from flexrun.store.signed import (
    MAGIC,
    MAX_RECORD,
    SignedStore,
    open_record,
    place_secret_file,
    remove_secret_file,
    seal,
    write_secret_file,
)
from flexrun.testing import FakeClock

SECRET = b"0123456789abcdef0123456789abcdef"


class LocalJudging(MemoryStore):
    """A memory store whose readers judge keep-alive TTLs, as the tcp store's do."""

    judges_ttl_locally = True


def _pair(store: MemoryStore | None = None, clock: FakeClock | None = None):  # type: ignore[no-untyped-def]
    clock = clock or FakeClock()
    raw = store if store is not None else MemoryStore(clock)
    rejected: list[tuple[str, str]] = []
    signed = SignedStore(raw, SECRET, clock=clock)
    signed.add_sink(lambda key, reason: rejected.append((key, reason)))
    return clock, raw, signed, rejected


def test_a_signed_value_reads_back_and_is_an_envelope_in_the_store() -> None:
    _, raw, signed, rejected = _pair()
    signed.put("job/k", b"value")
    assert signed.get("job/k").value == b"value"  # type: ignore[union-attr]
    stored = raw.get("job/k")
    assert stored is not None and stored.value.startswith(MAGIC + b" ") and b"value" in stored.value
    assert rejected == []


@pytest.mark.parametrize(
    "forged",
    [
        b'{"v":1,"node_id":"evil","addr":"10.0.0.9","nproc":8}',  # unsigned
        b"FXS1 " + b"0" * 64 + b" x.1 -\nvalue",  # wrong tag
        b"FXS1 abc",  # truncated header
        b"FXS1 " + b"0" * 64 + b" x.1\nvalue",  # missing field
        b"",  # empty
    ],
)
def test_a_forged_value_is_ignored_and_reported_once(forged: bytes) -> None:
    _, raw, signed, rejected = _pair()
    raw.put("job/s/nodes/evil", forged)
    assert signed.get("job/s/nodes/evil") is None
    assert signed.get_prefix("job/s/nodes/") == {}
    signed.get("job/s/nodes/evil")
    assert len(rejected) == 1 and rejected[0][0] == "job/s/nodes/evil"


def test_a_truncated_copy_of_a_real_record_does_not_verify() -> None:
    _, raw, signed, rejected = _pair()
    signed.put("job/k", b"a longer payload")
    assert signed.get("job/k") is not None  # this reader verified it once
    good = raw.get("job/k")
    assert good is not None
    raw.put("job/k", good.value[:-3])
    assert signed.get("job/k").value == b"a longer payload"  # type: ignore[union-attr]  (last verified)
    assert rejected and rejected[0][1] == "bad signature"


def test_a_huge_value_is_rejected_unread() -> None:
    _, raw, signed, rejected = _pair()
    raw.put("job/huge", MAGIC + b" " + b"x" * (MAX_RECORD + 1))
    assert signed.get("job/huge") is None
    assert "too large" in rejected[0][1]


def test_a_record_moved_to_another_key_does_not_verify() -> None:
    _, raw, signed, rejected = _pair()
    signed.put("job/s/round/master/3", b'{"addr":"10.0.0.1","port":1}')
    moved = raw.get("job/s/round/master/3")
    assert moved is not None
    raw.put("job/s/round/master/7", moved.value)
    assert signed.get("job/s/round/master/7") is None
    assert rejected == [("job/s/round/master/7", "bad signature")]


def test_junk_over_a_record_keeps_the_last_verified_value_and_cannot_block_a_cas() -> None:
    _, raw, signed, rejected = _pair()
    ok, first = signed.compare_and_set("job/s/round/current", b"round 1", expected_revision=0)
    assert ok and first is not None
    seen = signed.get("job/s/round/current")
    assert seen is not None and seen.value == b"round 1"
    raw.put("job/s/round/current", b'{"state":"failed","exit_code":42}')  # a forged FAILED round
    after = signed.get("job/s/round/current")
    assert after is not None and after.value == b"round 1" and after.revision == seen.revision
    # The writer's compare-and-set (expecting what it verified) goes through the junk.
    ok, entry = signed.compare_and_set(
        "job/s/round/current", b"round 2", expected_revision=seen.revision
    )
    assert ok and entry is not None
    assert signed.get("job/s/round/current").value == b"round 2"  # type: ignore[union-attr]
    assert len(rejected) == 1


def test_junk_written_before_any_record_cannot_block_a_create() -> None:
    _, raw, signed, _ = _pair()
    raw.put("job/s/round/watcher", b"junk that claims the watcher role")
    assert signed.get("job/s/round/watcher") is None
    ok, _ = signed.compare_and_set("job/s/round/watcher", b"me", expected_revision=0)
    assert ok and signed.get("job/s/round/watcher").value == b"me"  # type: ignore[union-attr]


def test_a_replayed_keep_alive_expires_by_its_sequence_on_a_locally_judging_store() -> None:
    clock = FakeClock()
    _, raw, signed, rejected = _pair(LocalJudging(clock), clock)
    signed.put("job/hb/dead", b"rec", ttl_s=3)
    captured = raw.get("job/hb/dead")
    assert captured is not None
    assert signed.get("job/hb/dead") is not None
    for _ in range(8):  # the node is dead; a stranger keeps writing its last keep-alive back
        clock.advance(0.5)
        raw.put("job/hb/dead", captured.value, ttl_s=3)
        signed.get("job/hb/dead")
    assert signed.get("job/hb/dead") is None
    assert any("replayed" in r for _, r in rejected)


def test_a_live_keep_alive_stays_fresh_and_junk_over_it_does_not_kill_it_early() -> None:
    clock = FakeClock()
    _, raw, signed, rejected = _pair(LocalJudging(clock), clock)
    for _ in range(6):
        signed.put("job/hb/a", b"rec", ttl_s=3)
        assert signed.get("job/hb/a") is not None
        clock.advance(1)
    raw.put("job/hb/a", b"junk", ttl_s=3)  # overwrites the real keep-alive between two beats
    assert signed.get("job/hb/a") is not None  # the last verified one, still fresh
    clock.advance(1)
    signed.put("job/hb/a", b"rec", ttl_s=3)
    assert signed.get("job/hb/a") is not None and not any("replayed" in r for _, r in rejected)


def test_on_a_lease_store_an_unchanged_keep_alive_is_resigned_only_every_half_ttl() -> None:
    clock = FakeClock()
    _, raw, signed, _ = _pair(MemoryStore(clock), clock)  # MemoryStore: expiry by the store
    signed.put("job/hb/a", b"rec", ttl_s=4)
    first = raw.get("job/hb/a")
    clock.advance(1)
    signed.put("job/hb/a", b"rec", ttl_s=4)
    assert raw.get("job/hb/a").value == first.value  # type: ignore[union-attr]  (same bytes: a lease refresh)
    clock.advance(1.5)
    signed.put("job/hb/a", b"rec", ttl_s=4)
    assert raw.get("job/hb/a").value != first.value  # type: ignore[union-attr]  (re-signed)
    # A replay of the first one is judged stale after 2 x TTL without a new sequence.
    captured = raw.get("job/hb/a")
    assert captured is not None
    for _ in range(10):
        clock.advance(1)
        raw.put("job/hb/a", captured.value, ttl_s=4)
        signed.get("job/hb/a")
    assert signed.get("job/hb/a") is None


def test_envelopes_bind_key_sequence_and_ttl() -> None:
    raw = seal(SECRET, "k", b"p", b"n.1", 5.0)
    opened = open_record(SECRET, "k", raw)
    assert not isinstance(opened, str) and opened.payload == b"p" and opened.ttl_s == 5.0
    assert open_record(SECRET, "other", raw) == "bad signature"
    assert open_record(b"another-secret-of-16+", "k", raw) == "bad signature"
    assert open_record(SECRET, "k", raw.replace(b" 5.0\n", b" 50.0\n")) == "bad signature"
    with pytest.raises(ValueError):
        SignedStore(MemoryStore(), b"short")


def test_a_secret_file_goes_where_it_was_asked_when_it_can(tmp_path: Path) -> None:
    placed = place_secret_file(tmp_path / "run" / ".job-secret-n0", b"k" * 32)
    assert placed == tmp_path / "run" / ".job-secret-n0"
    assert placed.read_bytes() == b"k" * 32 and placed.stat().st_mode & 0o777 == 0o600
    remove_secret_file(placed)
    assert not placed.exists() and (tmp_path / "run").is_dir()


def test_a_run_directory_that_cannot_take_the_secret_sends_it_to_a_private_directory(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "run"
    blocker.write_text("a file where the run directory should be")  # mkdir fails: ENOTDIR
    placed = place_secret_file(blocker / ".job-secret-n0", b"s" * 32)
    assert placed.read_bytes() == b"s" * 32
    assert placed.parent.name.startswith("flexrun-secret-")
    assert placed.parent.stat().st_mode & 0o777 == 0o700
    assert "cannot write the job secret" in caplog.text
    remove_secret_file(placed)
    assert not placed.parent.exists()


def test_a_write_that_fails_leaves_no_partial_secret_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = os.write
    calls = []

    def short(fd: int, data: bytes) -> int:
        calls.append(fd)
        return real(fd, data[:3])  # (a disk that fills after 3 bytes)

    monkeypatch.setattr(os, "write", short)
    with pytest.raises(OSError):
        write_secret_file(tmp_path / "secret", b"x" * 32)
    monkeypatch.undo()
    assert calls and list(tmp_path.iterdir()) == []
