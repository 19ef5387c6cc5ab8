"""flexrun status: reading a job's round, members, waiting nodes and keep-alives (in memory)."""

from __future__ import annotations

import json

import pytest

from flexrun.errors import ConfigError
from flexrun.observe.status import read_status, render_table, status_json, store_settings_from_args
from flexrun.rendezvous.state import Keys, MasterRecord, Member, NodeRecord, RoundRecord
from flexrun.testing import FakeClock, MemoryStore


class BeatingClock(FakeClock):
    """A fake clock during whose sleeps node ``a`` refreshes its keep-alive every 0.5 s."""

    def __init__(self, store: MemoryStore, keys: Keys) -> None:
        super().__init__()
        self.store, self.keys, self.next_beat = store, keys, 0.0
        self.t = 0.0

    def sleep(self, seconds: float) -> None:
        super().sleep(seconds)
        self.t += seconds
        if self.t >= self.next_beat:
            self.store.put(self.keys.heartbeat("a"), b"1", ttl_s=60)
            self.next_beat = self.t + 0.5


def _job(store: MemoryStore, keys: Keys) -> None:
    rnd = RoundRecord(
        number=3,
        state="running",
        reason="scale_up",
        members=(Member("a", "10.0.0.1", 2), Member("b", "10.0.0.2", 4)),
        restarts=1,
    )
    store.put(keys.round, rnd.encode())
    for node, addr, nproc in (("a", "10.0.0.1", 2), ("b", "10.0.0.2", 4), ("c", "10.0.0.3", 1)):
        store.put(keys.node(node), NodeRecord(node, addr, nproc, pid=100).encode())
    store.put(keys.heartbeat("a"), b"1", ttl_s=60)
    store.put(keys.heartbeat("c"), b"1", ttl_s=60)  # b's keep-alive has expired
    store.put(keys.master(3), MasterRecord("10.0.0.1", 29500).encode())


@pytest.mark.timeout(10)
def test_status_lists_members_with_ranks_and_heartbeats_and_the_waiting_node() -> None:
    store, keys = MemoryStore(), Keys("job")
    _job(store, keys)
    clock = BeatingClock(store, keys)
    st = read_status(store, "job", observe_s=1.2, clock=clock)
    assert (st.round, st.state, st.reason, st.world_size, st.restarts) == (
        3,
        "running",
        "scale_up",
        6,
        1,
    )
    assert st.master == "10.0.0.1:29500"
    a, b = st.members
    assert (a.node_id, a.group_rank, a.ranks, a.addr) == ("a", 0, (0, 1), "10.0.0.1")
    assert (b.node_id, b.group_rank, b.ranks) == ("b", 1, (2, 5))
    assert (
        a.heartbeat
        and a.heartbeat_exact
        and a.heartbeat_age_s is not None
        and a.heartbeat_age_s < 0.6
    )
    assert not b.heartbeat and b.heartbeat_age_s is None
    (c,) = st.waiting
    assert c.node_id == "c" and c.ranks is None and c.heartbeat and not c.heartbeat_exact
    assert c.heartbeat_age_s == pytest.approx(
        1.2, abs=0.11
    )  # a lower bound: unchanged in the window
    d = json.loads(status_json(st))
    assert [m["node_id"] for m in d["members"]] == ["a", "b"] and d["members"][1]["ranks"] == [2, 5]


@pytest.mark.timeout(10)
def test_status_table_names_every_node_and_marks_missing_heartbeats() -> None:
    from rich.console import Console

    store, keys = MemoryStore(), Keys("job")
    _job(store, keys)
    console = Console(record=True, width=160)
    console.print(render_table(read_status(store, "job", observe_s=0, clock=FakeClock())))
    text = console.export_text()
    for word in ("job", "running", "10.0.0.1", "10.0.0.2", "waiting", "missing", "2-5"):
        assert word in text


@pytest.mark.timeout(10)
def test_an_unknown_job_is_a_config_error_that_names_the_jobs_present() -> None:
    store, keys = MemoryStore(), Keys("job")
    _job(store, keys)
    with pytest.raises(ConfigError, match=r"'other'.*jobs in this store: job"):
        read_status(store, "other", observe_s=0, clock=FakeClock())
    with pytest.raises(ConfigError, match="holds no jobs"):
        read_status(MemoryStore(), "other", observe_s=0, clock=FakeClock())


@pytest.mark.timeout(10)
def test_a_forming_job_without_a_round_shows_its_nodes_as_waiting() -> None:
    store, keys = MemoryStore(), Keys("job")
    store.put(keys.node("a"), NodeRecord("a", "h", 1).encode())
    st = read_status(store, "job", observe_s=0, clock=FakeClock())
    assert st.round is None and st.state == "forming" and [n.node_id for n in st.waiting] == ["a"]


@pytest.mark.timeout(10)
def test_status_options_never_host_a_store_and_reject_bad_input() -> None:
    s = store_settings_from_args("c10d", "127.0.0.1:29400", "connect_timeout=3")
    assert not s.host_store and s.endpoints == (("127.0.0.1", 29400),) and s.connect_timeout_s == 3
    with pytest.raises(ConfigError, match="--rdzv-endpoint"):
        store_settings_from_args("c10d", "")
    with pytest.raises(ConfigError, match="unknown"):
        store_settings_from_args("zookeeper", "h:1")
