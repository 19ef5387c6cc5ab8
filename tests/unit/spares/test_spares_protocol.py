"""The spares wire: every request, reply, assignment and exit record is validated; a hostile
one is a SparesProtocolError (or, for a record, no record), never another exception."""

from __future__ import annotations

import json
import os
import pickle
import socket
from pathlib import Path

import pytest

from flexrun.errors import SparesProtocolError
from flexrun.spares.protocol import (
    MAX_TAKE,
    Assignment,
    Handover,
    Request,
    close_fds,
    exit_code_of,
    exit_record,
    interpreter,
    parse_agent_offer,
    parse_assignment,
    parse_handover,
    parse_reply,
    parse_request,
    parse_spare_offers,
    parse_status,
    read_line,
    read_returncode,
    record_exit,
    recv_line_with_fds,
    send_with_fds,
)

pytestmark = pytest.mark.timeout(30)


def test_requests_round_trip() -> None:
    for req in (
        Request(op="status"),
        Request(op="take", count=3, interpreter=interpreter()),
        Request(op="take_agent", count=1, interpreter="x"),
    ):
        assert parse_request(req.encode()) == req


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        (b"[1, 2]\n", "expected a JSON object, got list"),
        (b'"take"\n', "expected a JSON object, got str"),
        (b"null\n", "got NoneType"),
        (b"42\n", "got int"),
        (b"{}\n", "'op' is missing"),
        (b'{"op": 5}\n', "'op' must be str"),
        (b'{"op": "rm -rf"}\n', "unknown op"),
        (b'{"op": "take", "interpreter": "i"}\n', "'count' is missing"),
        (b'{"op": "take", "count": "2", "interpreter": "i"}\n', "'count' must be int"),
        (b'{"op": "take", "count": true, "interpreter": "i"}\n', "'count' must be int"),
        (b'{"op": "take", "count": 2.0, "interpreter": "i"}\n', "'count' must be int"),
        (b'{"op": "take", "count": 0, "interpreter": "i"}\n', "must be 1-"),
        (f'{{"op": "take", "count": {MAX_TAKE + 1}, "interpreter": "i"}}\n'.encode(), "must be 1-"),
        (b'{"op": "take", "count": 1, "interpreter": ["i"]}\n', "'interpreter' must be str"),
        (b'{"op": "take_agent"}\n', "'interpreter' is missing"),
        (b"\xff\xfe\x00garbage\n", "not a JSON line"),
        (b"{'op': 'status'}\n", "not a JSON line"),
        (b"[" * 200_000 + b"\n", "not a JSON line"),  # nested past the recursion limit
        (b'{"op": "take", "count": 1' + b"0" * 5000 + b', "interpreter": "i"}\n', "JSON"),
    ],
)
def test_a_hostile_request_is_a_protocol_error(line: bytes, needle: str) -> None:
    with pytest.raises(SparesProtocolError, match=needle.replace("(", r"\(")):
        parse_request(line)


def test_replies_are_checked_and_offers_stay_below_the_directory(tmp_path: Path) -> None:
    root = tmp_path / "spares"
    ok = {
        "pid": 12,
        "name": "w1-2",
        "ready": str(root / "spares/w1-2.ready"),
        "log_dir": str(root / "spares/w1-2"),
    }
    reply, error = parse_reply(json.dumps({"spares": [ok]}).encode())
    assert error is None
    (offer,) = parse_spare_offers(reply, root)
    assert offer.pid == 12 and offer.log_dir == root / "spares/w1-2"
    assert parse_reply(b'{"error": "not taken"}\n')[1] == "not taken"
    for bad in (
        {"spares": "x"},
        {"spares": [1]},
        {"spares": [{**ok, "pid": "12"}]},
        {"spares": [{**ok, "pid": 0}]},
        {"spares": [{**ok, "name": "../../etc/passwd"}]},
        {"spares": [{**ok, "name": ".hidden"}]},
        {"spares": [{**ok, "ready": "/etc/shadow"}]},
        {"spares": [{**ok, "log_dir": str(root / "../elsewhere")}]},
        {"spares": [{**ok, "log_dir": "relative/dir"}]},
    ):
        with pytest.raises(SparesProtocolError):
            parse_spare_offers(bad, root)
    sock = str(root / "spares/a1-1.sock")
    assert parse_agent_offer({"pid": 0}, root) is None
    assert parse_agent_offer({"pid": 9, "name": "a1-1", "socket": sock}, root) is not None
    for bad in ({}, {"pid": "9"}, {"pid": 9, "name": "a", "socket": "/tmp/x.sock"}):
        with pytest.raises(SparesProtocolError):
            parse_agent_offer(bad, root)
    with pytest.raises(SparesProtocolError):
        parse_reply(b'{"error": 3}\n')
    status = {
        "pid": 1,
        "ready": 2,
        "booting": 0,
        "agents_ready": 0,
        "handed_out": 1,
        "interpreter": "i",
    }
    assert parse_status(status) == status
    for key, value in (("ready", -1), ("booting", "0"), ("interpreter", None)):
        with pytest.raises(SparesProtocolError):
            parse_status({**status, key: value})


def test_assignments_and_handovers_round_trip_and_refuse_wrong_types() -> None:
    task = Assignment(
        entry="w.py",
        args=("a", "b"),
        module=False,
        env={"A": "1"},
        cwd="/",
        stdout="/x/stdout.log",
        agent_pid=7,
        private_output=True,
    )
    assert parse_assignment(task.encode()) == task
    raw = json.loads(task.encode())
    for key, value in (
        ("args", "a b"),
        ("args", [1]),
        ("env", {"A": 1}),
        ("env", ["A"]),
        ("module", "yes"),
        ("agent_pid", "7"),
        ("cwd", None),
        ("private_output", "yes"),
    ):
        with pytest.raises(SparesProtocolError):
            parse_assignment(json.dumps({**raw, key: value}).encode())
    hand = Handover(argv=("run", "x.py"), env={"PATH": "/bin"}, cwd="/tmp")
    assert parse_handover(hand.encode()) == hand
    with pytest.raises(SparesProtocolError):
        parse_handover(b'{"argv": "run x.py", "env": {}, "cwd": "/"}\n')


def test_lines_longer_than_the_limit_are_refused() -> None:
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"x" * 5000)
        with pytest.raises(SparesProtocolError, match="over 1000 bytes"):
            read_line(b, limit=1000)
        a.sendall(b'{"op": "status"}\nmore')
        assert read_line(b, limit=1000) == b'{"op": "status"}\n'


def test_exit_records_are_json_only_and_a_pickle_runs_nothing(tmp_path: Path) -> None:
    (tmp_path / "exits").mkdir()
    path = exit_record(tmp_path, "w1-1")
    record_exit(path, 3)
    assert read_returncode(path) == 3
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self) -> tuple:
            return (open, (str(marker), "w"))

    for junk in (pickle.dumps(Payload()), b'{"returncode": "3"}', b"[3]", b"\xff", b""):
        path.write_bytes(junk)
        assert read_returncode(path) is None
    assert not marker.exists()
    assert read_returncode(tmp_path / "exits" / "absent.json") is None
    with pytest.raises(SparesProtocolError):
        exit_record(tmp_path, "../escape")
    assert [exit_code_of(c) for c in (None, 0, 5, "boom")] == [0, 0, 5, 1]


def test_a_message_taken_whole_is_not_followed_by_an_empty_send_to_a_closed_peer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The warm agent reads the whole hand-over, answers "ok" and closes; the client then sent
    # the (empty) rest and got EPIPE, so it killed a working agent (the old flaky test
    # test_a_flexrun_run_hands_itself_to_a_warm_agent). Here the peer has certainly closed
    # before the rest would be sent.
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    r, w = os.pipe()
    taken: list[bytes] = []
    real_send_fds = socket.send_fds

    def send_then_peer_closes(sock: socket.socket, buffers: list[bytes], fds: list[int]) -> int:
        sent = real_send_fds(sock, buffers, fds)
        data, got = recv_line_with_fds(b, 1 << 16, 3)
        taken.append(data)
        close_fds(got)
        b.sendall(b"ok\n")
        b.close()
        return sent

    monkeypatch.setattr(socket, "send_fds", send_then_peer_closes)
    try:
        send_with_fds(a, b'{"x": 1}\n', [r])
    finally:
        a.close()
        os.close(r)
        os.close(w)
    assert taken == [b'{"x": 1}\n']
