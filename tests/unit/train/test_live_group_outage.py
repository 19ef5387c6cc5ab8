"""EpochGroup through a store outage and with a job secret, on a real in-process store:
a formed group trains on while the store is away, an agreement interrupted by a store
restart completes, and a record written without the secret is ignored."""

from __future__ import annotations

import gc
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from members_support import run_members

from flexrun.events import EventLog
from flexrun.live_protocol import EpochRecord, LiveEnv, LiveKeys
from flexrun.store.factory import connect_from_env
from flexrun.store.tcp import TcpStore, TcpStoreServer
from flexrun.train.live_group import OUTAGE_RETRY_S, EpochGroup
from flexrun.train.live_plan import MemberReport

pytestmark = pytest.mark.timeout(90)


class Server:
    """A store that can be stopped and started again on the same port."""

    def __init__(self) -> None:
        self.srv: TcpStoreServer | None = TcpStoreServer("127.0.0.1", 0)
        self.port = self.srv.port

    def stop(self) -> None:
        assert self.srv is not None
        self.srv.close()
        self.srv = None
        gc.collect()

    def start(self) -> None:
        self.srv = TcpStoreServer("127.0.0.1", self.port)


@pytest.fixture
def server() -> Iterator[Server]:
    s = Server()
    yield s
    if s.srv is not None:
        s.srv.close()


def _env(port: int, worker: str, tmp: Path) -> LiveEnv:
    return LiveEnv(
        store_host="127.0.0.1",
        store_port=port,
        run_id="unit",
        worker_id=worker,
        heartbeat_file=tmp / f"{worker}.hb",
        heartbeat_interval_s=0.5,
        run_dir=None,
        round=0,
    )


def _group(server: Server, worker: str, tmp: Path, **kw: Any) -> EpochGroup:
    events = EventLog(tmp / worker, run_id="unit", node=worker)
    return EpochGroup(
        _env(server.port, worker, tmp), timeout_s=20, environ=kw.get("environ", {}), events=events
    )


def _events(tmp: Path, worker: str) -> list[dict]:
    path = tmp / worker / "events.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _form(a: EpochGroup, b: EpochGroup, rec: EpochRecord) -> None:
    def join(g: EpochGroup, report: MemberReport) -> tuple[int, int]:
        g.agree(rec, report, has_state=True)
        return g.form(rec)

    got = run_members(
        [lambda: join(a, MemberReport(0, True)), lambda: join(b, MemberReport(0, True))]
    )
    assert got == [(0, 2), (1, 2)], got


def test_a_formed_group_trains_on_while_the_store_is_away_and_sees_the_next_epoch(
    server: Server, tmp_path: Path
) -> None:
    a, b = _group(server, "a", tmp_path), _group(server, "b", tmp_path)
    rec = EpochRecord(1, ("a", "b"), False)
    a.store.put(LiveKeys("unit").epoch, rec.encode())
    _form(a, b, rec)

    server.stop()
    t0 = time.monotonic()
    for _ in range(5):  # a step: epoch checks, then the all-reduce on the formed group
        xa, xb = torch.ones(4), torch.full((4,), 2.0)
        run_members(
            [lambda xa=xa: a.wait(a.pg.allreduce([xa])), lambda xb=xb: b.wait(b.pg.allreduce([xb]))]
        )
        assert torch.equal(xa, torch.full((4,), 3.0)) and torch.equal(xb, xa)
        a.check_epoch(time.monotonic() + 1)
    assert time.monotonic() - t0 < 5, "epoch checks blocked the steps"
    assert a.down_since is not None and not a.pending_change
    assert "store_unavailable" in [e["event"] for e in _events(tmp_path, "a")]

    server.start()
    TcpStore("127.0.0.1", server.port).put(
        LiveKeys("unit").epoch, EpochRecord(2, ("a", "b"), False).encode()
    )
    deadline = time.monotonic() + 10
    while not a.pending_change and time.monotonic() < deadline:
        a.check_epoch(time.monotonic())
        time.sleep(OUTAGE_RETRY_S / 5)
    assert a.pending_change and a.down_since is None
    assert "store_recovered" in [e["event"] for e in _events(tmp_path, "a")]
    a.leak_all()
    b.leak_all()


def test_an_agreement_interrupted_by_a_store_restart_completes(
    server: Server, tmp_path: Path
) -> None:
    a, b = _group(server, "a", tmp_path), _group(server, "b", tmp_path)
    rec = EpochRecord(1, ("a", "b"), False)

    def late_b() -> list[MemberReport]:
        time.sleep(0.5)
        server.stop()  # a's report is lost with the store
        time.sleep(1.0)
        server.start()
        return b.agree(rec, MemberReport(3, True, "x"), has_state=True)

    got = run_members([lambda: a.agree(rec, MemberReport(3, True, "x"), has_state=True), late_b])
    expected = [MemberReport(3, True, "x")] * 2
    assert got == [expected, expected], got
    assert "store_unavailable" in [e["event"] for e in _events(tmp_path, "a")]
    a.leak_all()
    b.leak_all()


def test_with_a_secret_a_record_written_without_it_is_ignored(
    server: Server, tmp_path: Path
) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"k" * 32)
    secret.chmod(0o600)
    environ = {"FLEXRUN_JOB_SECRET_FILE": str(secret)}
    a = _group(server, "a", tmp_path, environ=environ)
    agent = connect_from_env("127.0.0.1", server.port, environ)  # the agents sign
    good = EpochRecord(1, ("a",), False)
    agent.put(LiveKeys("unit").epoch, good.encode())
    assert a.read_epoch() == good
    TcpStore("127.0.0.1", server.port).put(
        LiveKeys("unit").epoch, EpochRecord(9, ("intruder",), True).encode()
    )
    assert a.read_epoch() == good  # the forgery does not verify: the last good one stands
    rejected = [e for e in _events(tmp_path, "a") if e["event"] == "store_record_rejected"]
    assert rejected and rejected[0]["key"] == LiveKeys("unit").epoch


def test_a_group_left_forming_while_the_store_is_away_agrees_next_on_a_new_connection(
    server: Server, tmp_path: Path
) -> None:
    """A forming thread left behind keeps the old raw connection (blocked in gloo's wait,
    it would hold every request behind it); when no new one can be had at that moment,
    the next agreement makes one instead of queueing on the old."""
    a, b = _group(server, "a", tmp_path), _group(server, "b", tmp_path)
    server.stop()
    a._raw.left_behind()
    assert a._raw.stale

    class Held:
        def __getattr__(self, name: str) -> Any:
            raise AssertionError(f"the connection a forming thread holds was used ({name})")

    a._raw.conn = Held()
    server.start()
    rec = EpochRecord(2, ("a", "b"), False)
    TcpStore("127.0.0.1", server.port).put(LiveKeys("unit").epoch, rec.encode())
    _form(a, b, rec)
    assert not a._raw.stale
    a.leak_all()
    b.leak_all()
