"""Fuzz: the spares protocol (requests, replies, offers, hand-overs, assignments, exit
records), which crosses a Unix socket and files in the spares directory.

Property: :class:`SparesProtocolError` (answered as an error, never a crash) or a value of
the right types, and every path an offer names lies below the spares directory.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fuzz_support import FUZZ, hostile_bytes, mangled
from hypothesis import given
from hypothesis import strategies as st

from flexrun.errors import SparesProtocolError
from flexrun.spares.protocol import (
    AgentOffer,
    Assignment,
    Handover,
    Request,
    SpareOffer,
    encode,
    parse_agent_offer,
    parse_assignment,
    parse_handover,
    parse_reply,
    parse_request,
    parse_spare_offers,
    parse_status,
    read_returncode,
)

pytestmark = pytest.mark.timeout(120)

ROOT = Path("/tmp/flexrun-fuzz-spares")
LINES = {
    "request": (
        Request(op="take", count=2, interpreter="/usr/bin/python3").encode(),
        parse_request,
    ),
    "handover": (
        Handover(argv=("flexrun", "run"), env={"A": "1"}, cwd="/").encode(),
        parse_handover,
    ),
    "assignment": (
        Assignment(
            entry="train.py", args=("--x",), module=False, env={"A": "1"}, cwd="/", agent_pid=3
        ).encode(),
        parse_assignment,
    ),
    "reply": (encode({"error": "no", "spares": []}), parse_reply),
}


@FUZZ
@given(data=st.data(), kind=st.sampled_from(sorted(LINES)))
def test_a_hostile_line_is_a_protocol_error_or_a_message(data: st.DataObject, kind: str) -> None:
    valid, parse = LINES[kind]
    try:
        got = parse(hostile_bytes(data, valid.rstrip(b"\n")))
    except SparesProtocolError as exc:
        assert str(exc) and "\n" not in str(exc)
        return
    if isinstance(got, Assignment | Handover):
        assert all(isinstance(v, str) for v in got.env.values())


OFFERS = {
    "spares": {
        "spares": [
            SpareOffer(
                pid=10, name="s-1", ready=ROOT / "s-1.ready", log_dir=ROOT / "logs"
            ).as_dict()
        ]
    },
    "agent": AgentOffer(pid=11, name="a-1", socket=ROOT / "a-1.sock").as_dict(),
    "status": {
        "pid": 1,
        "ready": 1,
        "booting": 0,
        "agents_ready": 0,
        "handed_out": 2,
        "interpreter": "/usr/bin/python3",
    },
}


@FUZZ
@given(data=st.data(), kind=st.sampled_from(sorted(OFFERS)))
def test_a_hostile_offer_is_a_protocol_error_or_stays_below_the_directory(
    data: st.DataObject, kind: str
) -> None:
    reply = mangled(data, OFFERS[kind])
    if not isinstance(reply, dict):
        return  # parse_reply (above) refuses a reply that is not an object
    try:
        if kind == "spares":
            for s in parse_spare_offers(reply, ROOT):
                assert s.ready.resolve().is_relative_to(ROOT) and s.pid > 0
                assert s.log_dir.resolve().is_relative_to(ROOT)
        elif kind == "agent":
            a = parse_agent_offer(reply, ROOT)
            assert a is None or (a.socket.resolve().is_relative_to(ROOT) and a.pid > 0)
        else:
            counts = parse_status(reply)
            assert all(isinstance(counts[k], int) and counts[k] >= 0 for k in ("ready", "pid"))
    except SparesProtocolError as exc:
        assert str(exc)


@FUZZ
@given(data=st.data())
def test_a_hostile_exit_record_is_none_or_an_exit_code(
    data: st.DataObject, tmp_path_factory: pytest.TempPathFactory
) -> None:
    path = tmp_path_factory.getbasetemp() / "exit.json"
    path.write_bytes(hostile_bytes(data, b'{"pid": 5, "returncode": 3}'))
    rc = read_returncode(path)
    assert rc is None or (isinstance(rc, int) and not isinstance(rc, bool))
