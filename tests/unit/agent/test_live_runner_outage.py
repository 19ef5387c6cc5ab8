"""Store outages at the agent: a join that meets a restarting store, a live worker that dies
while the store is away, and a live epoch that a restarted store lost.

Fake processes, the in-memory store behind a switch, a fake clock: milliseconds per test.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import pytest
from test_agent_loop import FakeRendezvous, FakeRunner, finished, make
from test_runners import FakePool, config, events_of, rnd

from flexrun.agent import policy as p
from flexrun.agent.live import LiveRunner
from flexrun.agent.live_epochs import EpochPublisher
from flexrun.errors import StoreUnavailable
from flexrun.events import EventLog
from flexrun.exitcodes import STORE_LOST
from flexrun.live_protocol import EpochRecord, LiveKeys, NodeWorkers, mark_state, touch_heartbeat
from flexrun.rendezvous import Run
from flexrun.store.api import Entry
from flexrun.testing import MemoryStore


class SwitchedStore:
    """A store that can be taken down (every call raises) and restarted empty."""

    def __init__(self) -> None:
        self.inner = MemoryStore()
        self.down = False

    def restart(self) -> None:
        self.inner = MemoryStore()

    def _up(self) -> MemoryStore:
        if self.down:
            raise StoreUnavailable("store at 127.0.0.1:1 failed: Connection refused")
        return self.inner

    def get(self, key: str) -> Entry | None:
        return self._up().get(key)

    def get_prefix(self, prefix: str) -> dict[str, Entry]:
        return self._up().get_prefix(prefix)

    def put(self, key: str, value: bytes, *, ttl_s: float | None = None) -> int:
        return self._up().put(key, value, ttl_s=ttl_s)

    def put_many(self, items: Mapping[str, bytes]) -> int:
        return self._up().put_many(items)

    def compare_and_set(
        self, key: str, value: bytes, *, expected_revision: int
    ) -> tuple[bool, int]:
        return self._up().compare_and_set(key, value, expected_revision=expected_revision)


def epoch(store: SwitchedStore) -> EpochRecord:
    entry = store.get(LiveKeys("job").epoch)
    assert entry is not None
    return EpochRecord.decode(entry.value)


# -- the agent's join ------------------------------------------------------------------------
class FlakyJoin(FakeRendezvous):
    def __init__(self, failures: int, script: list) -> None:  # type: ignore[type-arg]
        super().__init__(script)
        self.failures = failures
        self.joins = 0

    def join(self) -> None:
        self.joins += 1
        if self.failures:
            self.failures -= 1
            raise StoreUnavailable("store at 127.0.0.1:1 failed: Failed to recv")


@pytest.mark.timeout(10)
def test_an_agent_whose_join_meets_a_restarting_store_retries_and_trains(tmp_path) -> None:
    rdzv = FlakyJoin(3, [Run(rnd(1, ("n1", 1)))])
    agent, _ = make(tmp_path, rdzv, FakeRunner([None, finished()]))
    assert agent.run() == 0
    assert rdzv.joins == 4
    kinds = [e["event"] for e in events_of(tmp_path)]
    assert "store_unavailable" in kinds and "store_recovered" in kinds


@pytest.mark.timeout(10)
def test_a_store_that_never_returns_ends_a_joining_agent_with_store_lost_not_bad_input(
    tmp_path,
) -> None:
    rdzv = FlakyJoin(10**6, [])
    agent, clock = make(tmp_path, rdzv, FakeRunner([]))
    code = agent.run()
    assert code == STORE_LOST != 2
    assert clock.monotonic() > agent.config.rendezvous.join_timeout_s
    assert "store_lost" in [e["event"] for e in events_of(tmp_path)]


# -- a live worker that dies while the store is away -----------------------------------------
def live_runner(tmp_path: Path, store: SwitchedStore, pool: FakePool) -> LiveRunner:
    c = config(tmp_path)
    return LiveRunner(
        c,
        node_id="n1",
        store=store,  # type: ignore[arg-type]
        store_addr=("127.0.0.1", 1),
        events=EventLog(c.output.run_dir, run_id="job", node="n1"),
        pool=pool,  # type: ignore[arg-type]
    )


@pytest.mark.timeout(20)
def test_a_live_worker_lost_during_an_outage_is_replaced_and_reported_once_it_returns(
    tmp_path: Path,
) -> None:
    store, pool = SwitchedStore(), FakePool(tmp_path)
    runner = live_runner(tmp_path, store, pool)
    runner.run_round(rnd(1, ("n1", 2)), None)
    for lw in runner.slots.values():
        touch_heartbeat(lw.heartbeat)
        mark_state(lw.heartbeat)
    store.put(LiveKeys("job").formed, b"1")
    store.down = True
    runner.slots[0].worker.proc.end(-9)  # type: ignore[attr-defined]
    for _ in range(3):  # the agent's loop retries while the store is away
        with pytest.raises(StoreUnavailable):
            runner.poll()
    assert epoch_unchanged(store)
    store.down = False
    ev = runner.poll()
    assert isinstance(ev, p.LiveFailed) and [c.worker_id for c in ev.causes] == ["n1.w1"]
    assert 0 in runner.slots and runner.slots[0].worker_id == "n1.w3"
    rec = epoch(store)
    assert rec.number == 2 and rec.abort and "n1.w1" not in rec.members
    assert runner.poll() is None  # reported once
    runner.close()


def epoch_unchanged(store: SwitchedStore) -> bool:
    store.down = False
    try:
        return epoch(store).number == 1
    finally:
        store.down = True


# -- a restarted store lost the epoch ----------------------------------------------------------
def publisher(tmp_path: Path, store: SwitchedStore, node: str) -> EpochPublisher:
    events = EventLog(tmp_path / node, run_id="job", node=node)
    return EpochPublisher(store, run_id="job", node_id=node, events=events)  # type: ignore[arg-type]


@pytest.mark.timeout(10)
def test_a_restarted_store_gets_the_node_records_and_an_epoch_above_the_last_again(
    tmp_path: Path,
) -> None:
    store = SwitchedStore()
    keys = LiveKeys("job")
    a, b = publisher(tmp_path, store, "a"), publisher(tmp_path, store, "b")
    r = rnd(3, ("a", 1), ("b", 1))
    a.publish(r, ["a.w1"])
    b.publish(r, ["b.w1"])
    assert epoch(store) == EpochRecord(2, ("a.w1", "b.w1"), False)  # (a alone first: 1)
    store.put(keys.formed, b"2")
    a.publish(r, ["a.w1"])
    b.publish(r, ["b.w1"])
    assert a.formed() and b.formed()

    store.restart()
    a.publish(r, ["a.w1"])
    # a's record is back; b's not yet: no epoch that would leave b's workers out.
    assert store.get(keys.node("a")) is not None and store.get(keys.epoch) is None
    assert a.current() == EpochRecord(2, ("a.w1", "b.w1"), False)  # (as far as a knows)
    b.publish(r, ["b.w1"])
    rec = epoch(store)
    assert rec == EpochRecord(3, ("a.w1", "b.w1"), False)  # above the last, not an abort
    assert store.get(keys.formed) is not None
    node_b = store.get(keys.node("b"))
    assert node_b is not None and NodeWorkers.decode(node_b.value).workers == ("b.w1",)
    a.publish(r, ["a.w1"])
    assert epoch(store) == rec  # published once
    assert "live_epoch_restored" in [e["event"] for e in events_of(tmp_path / "b")]


@pytest.mark.timeout(10)
def test_an_agent_still_in_an_older_round_leaves_a_newer_rounds_epoch_alone(
    tmp_path: Path,
) -> None:
    """After c left, b's round (6) no longer has c while a is still in round 5 with it: a
    must not put c's workers back over b's epoch (the two would replace each other's
    epoch at every poll until a's round caught up: an epoch storm); once a is in round
    6 it agrees, and nothing more is published."""
    store = SwitchedStore()
    a, b = publisher(tmp_path, store, "a"), publisher(tmp_path, store, "b")
    old, new = rnd(5, ("a", 1), ("b", 1), ("c", 1)), rnd(6, ("a", 1), ("b", 1))
    c = publisher(tmp_path, store, "c")
    for node, who in ((a, "a.w1"), (b, "b.w1"), (c, "c.w1")):
        node.publish(old, [who])
    three = epoch(store)
    assert three.members == ("a.w1", "b.w1", "c.w1") and three.round == 5
    # c is gone (SIGTERMed: its record still names its worker); b's round 6 knows it.
    b.publish(new, ["b.w1"])
    two = epoch(store)
    assert two.number == three.number + 1 and two.members == ("a.w1", "b.w1") and two.abort
    for _ in range(5):
        a.publish(old, ["a.w1"])  # (a's view: c still there)
        b.publish(new, ["b.w1"])
    assert epoch(store) == two and epoch(store).round == 6
    a.publish(new, ["a.w1"])
    assert epoch(store) == two
