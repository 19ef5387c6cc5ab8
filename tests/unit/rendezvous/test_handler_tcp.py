"""The handler on the real tcp store (readers judge keep-alive TTLs) with a fake clock."""

from __future__ import annotations

import pytest

from flexrun.config import RendezvousSettings
from flexrun.observe.events import EventLog
from flexrun.rendezvous import NodeRecord, RendezvousHandler, Run
from flexrun.store.tcp import TcpStore, TcpStoreServer
from flexrun.testing import FakeClock

S = RendezvousSettings(
    min_nodes=1, max_nodes=3, last_call_s=0, heartbeat_interval_s=1, heartbeat_timeout_s=3
)


def _join(port: int, node: str, clock: FakeClock) -> RendezvousHandler:
    h = RendezvousHandler(
        TcpStore("127.0.0.1", port, connect_timeout_s=5, clock=clock),
        run_id="job",
        me=NodeRecord(node, "127.0.0.1", 1),
        settings=S,
        events=EventLog(None, run_id="job", node=node),
        clock=clock,
    )
    h._beat()  # one keep-alive, no thread: the test drives time
    h.store.put(h.keys.node(node), h.me.encode())
    return h


def _settle(h: RendezvousHandler, running: int | None) -> Run:
    for _ in range(5):
        act = h.step(running)
        if isinstance(act, Run):
            return act
    raise AssertionError(f"{h.me.node_id} did not get a round: {act}")


@pytest.mark.timeout(60)
def test_a_node_joining_after_a_kill_does_not_start_a_round_storm() -> None:
    """Chaos finding: n1 was killed; n2 dropped it (node_lost); n3, started just then,
    first saw n1's last keep-alive and counted it alive for a full TTL: n3 proposed rounds
    with n1 (scale_up), n2 dropped it again (node_lost): ~70 rounds in 2 s."""
    clock = FakeClock()
    server = TcpStoreServer("127.0.0.1", 0)
    hs: list[RendezvousHandler] = []
    try:
        n1, n2 = _join(server.port, "n1", clock), _join(server.port, "n2", clock)
        hs += [n1, n2]
        r1 = _settle(n1, None).round
        assert _settle(n2, None).round == r1 and r1.member_ids == ["n1", "n2"]
        clock.advance(1.0)
        n1._beat()  # n1's last keep-alive, then kill -9
        for _ in range(6):  # n2 judges n1's keep-alive stale 3 s after it first saw it
            clock.advance(1.0)
            n2._beat()
            n2.step(r1.number)
        r2 = _settle(n2, r1.number).round  # n2 noticed: round without n1
        assert r2.member_ids == ["n2"] and r2.reason == "node_lost"
        n3 = _join(server.port, "n3", clock)  # its client sees n1's keep-alive for the 1st time
        hs.append(n3)
        rounds = set()
        running = {"n2": r2.number, "n3": None}
        for _ in range(6):  # the two nodes step in turn within one TTL
            for h in (n3, n2):
                act = h.step(running[h.me.node_id])
                if isinstance(act, Run):
                    running[h.me.node_id] = act.round.number
                    rounds.add(act.round.number)
                assert h.round is not None and "n1" not in h.round.member_ids, h.round
            clock.advance(0.1)
        assert len(rounds) == 1, f"rounds kept changing: {sorted(rounds)}"
        assert n2.round is not None and n2.round.member_ids == ["n2", "n3"]
        # n1 comes back for real (a new agent beating): it is taken in once seen renewed.
        n1._beat()
        n1.store.put(n1.keys.node("n1"), n1.me.encode())
        clock.advance(1.0)
        n1._beat()
        for h in (n2, n3):
            h._beat()
        act = _settle(n1, None)
        assert act.round.member_ids == ["n2", "n3", "n1"]
    finally:
        for h in hs:
            h.store.close()
        server.close()
