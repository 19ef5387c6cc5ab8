"""Fuzz: every record a node reads from the store (issue 18, "a fuzz suite").

Rendezvous records (node, slice, round header and self-contained round, member chunk,
watcher claim, master), live-mode records (epoch, node workers, member report) and the
signed envelope. Anyone who reaches an unauthenticated store can write any bytes under a
job's keys, so each decoder meets mangled valid records, random bytes, truncations,
non-UTF-8 bytes and documents nested too deep. Property: the decoder's documented error
(:class:`RendezvousError`; ``ValueError`` for the live-protocol records, whose readers
catch it) or a record of the right types; never another exception.
"""

from __future__ import annotations

import pytest
from fuzz_support import DEEP, FUZZ, HOW, hostile_bytes
from hypothesis import given
from hypothesis import strategies as st

from flexrun.cause import FailureCause
from flexrun.errors import RendezvousError
from flexrun.live_protocol import EpochRecord, MemberReport, NodeWorkers
from flexrun.rendezvous.records import asked_digest
from flexrun.rendezvous.state import (
    Claim,
    MasterRecord,
    Member,
    NodeRecord,
    RoundRecord,
    Slice,
    decode_chunk,
    encode_chunk,
    slices_of,
)
from flexrun.store.signed import SignedStore, open_record, seal
from flexrun.testing import MemoryStore

pytestmark = pytest.mark.timeout(120)

MEMBERS = (Member("a", "10.0.0.1", 2), Member("b", "10.0.0.2", 4))
ROUND = RoundRecord(
    number=3,
    state="failed",
    members=MEMBERS,
    restarts=1,
    reason="failure",
    exit_code=1,
    root_cause=FailureCause(rank=1, node="b", exit_code=1, message="ValueError: x"),
)
RENDEZVOUS = {
    "node": (NodeRecord("a", "10.0.0.1", 2, pid=7).encode(), NodeRecord.decode),
    "slice": (slices_of(MEMBERS)[1].encode(), Slice.decode),
    "round": (ROUND.encode(), RoundRecord.decode),
    "header": (ROUND.header(), RoundRecord.decode),
    "claim": (Claim("a", 4).encode(), Claim.decode),
    "master": (MasterRecord("10.0.0.1", 29500).encode(), MasterRecord.decode),
}


@FUZZ
@given(data=st.data(), kind=st.sampled_from(sorted(RENDEZVOUS)))
def test_a_hostile_rendezvous_record_is_a_rendezvous_error_or_a_record(
    data: st.DataObject, kind: str
) -> None:
    valid, decode = RENDEZVOUS[kind]
    raw = hostile_bytes(data, valid)
    try:
        rec = decode(raw)
    except RendezvousError as exc:
        assert str(exc)
        return
    if isinstance(rec, RoundRecord):
        assert isinstance(rec.number, int) and isinstance(rec.state, str)
        assert rec.root_cause is None or isinstance(rec.root_cause, FailureCause)
    elif isinstance(rec, NodeRecord):
        assert isinstance(rec.nproc, int) and isinstance(rec.node_id, str)


@FUZZ
@given(data=st.data())
def test_a_hostile_member_chunk_is_a_rendezvous_error_or_members(data: st.DataObject) -> None:
    digest = "d" * 16
    raw = hostile_bytes(data, encode_chunk(digest, 0, MEMBERS))
    try:
        got = decode_chunk(raw, digest, 0)
    except RendezvousError:
        return
    assert all(isinstance(m.nproc, int) and isinstance(m.node_id, str) for m in got)


@FUZZ
@given(raw=st.binary(max_size=200))
def test_a_slice_request_never_raises(raw: bytes) -> None:
    assert isinstance(asked_digest(raw), str)


LIVE = {
    "epoch": (EpochRecord(2, ("a/0", "b/0"), False).encode(), EpochRecord.decode),
    "workers": (NodeWorkers(1, ("a/0", "a/1")).encode(), NodeWorkers.decode),
    "report": (MemberReport(10, True, "abc").encode().encode(), MemberReport.decode),
}


@FUZZ
@given(data=st.data(), kind=st.sampled_from(sorted(LIVE)))
def test_a_hostile_live_record_is_a_value_error_or_a_record(data: st.DataObject, kind: str) -> None:
    valid, decode = LIVE[kind]
    try:
        decode(hostile_bytes(data, valid, tuple(h for h in HOW if h != "deep")))
    except ValueError as exc:
        assert str(exc)


@pytest.mark.parametrize("kind", sorted(LIVE))
def test_a_live_record_nested_too_deep_is_a_value_error(kind: str) -> None:
    with pytest.raises(ValueError):
        LIVE[kind][1](DEEP)


SECRET = b"s" * 32


@FUZZ
@given(data=st.data())
def test_the_signed_envelope_never_raises_and_never_verifies_a_forgery(
    data: st.DataObject,
) -> None:
    good = seal(SECRET, "flexrun/j/s/round", b'{"v":1}', b"n.1", 30.0)
    how = data.draw(st.sampled_from(["random", "flip", "truncate", "other_key", "wrong_secret"]))
    if how == "random":
        raw = data.draw(st.binary(max_size=120))
    elif how == "flip":
        at = data.draw(st.integers(0, len(good) - 1))
        raw = good[:at] + bytes([good[at] ^ data.draw(st.integers(1, 255))]) + good[at + 1 :]
    elif how == "truncate":
        raw = good[: data.draw(st.integers(0, len(good) - 1))]
    elif how == "other_key":
        raw = good
    else:
        raw = seal(b"t" * 32, "flexrun/j/s/round", b'{"v":1}', b"n.1", 30.0)
    key = "flexrun/j/s/node/a" if how == "other_key" else "flexrun/j/s/round"
    got = open_record(SECRET, key, raw)
    assert isinstance(got, str), got  # nothing but the exact sealed record verifies


@FUZZ
@given(raws=st.lists(st.binary(max_size=80), min_size=1, max_size=4))
def test_a_signed_store_hides_what_a_stranger_wrote_and_reports_it(raws: list[bytes]) -> None:
    inner = MemoryStore()
    store = SignedStore(inner, SECRET)
    rejected: list[tuple[str, str]] = []
    store.add_sink(lambda k, why: rejected.append((k, why)))
    store.put("flexrun/j/s/nodes/good", b"mine")
    for i, raw in enumerate(raws):
        inner.put(f"flexrun/j/s/nodes/x{i}", raw)
    assert store.get("flexrun/j/s/nodes/x0") is None
    got = store.get_prefix("flexrun/j/s/nodes/")
    assert (
        list(got) == ["flexrun/j/s/nodes/good"] and got["flexrun/j/s/nodes/good"].value == b"mine"
    )
    assert {k for k, _ in rejected} == {f"flexrun/j/s/nodes/x{i}" for i in range(len(raws))}


@pytest.mark.parametrize("kind", sorted(RENDEZVOUS))
def test_an_infinite_number_or_a_too_deep_record_is_a_rendezvous_error(kind: str) -> None:
    import json

    valid, decode = RENDEZVOUS[kind]
    doc = json.loads(valid)
    for raw in (
        DEEP,
        json.dumps({k: float("inf") if k != "v" else v for k, v in doc.items()}).encode(),
    ):
        with pytest.raises(RendezvousError):
            decode(raw)
