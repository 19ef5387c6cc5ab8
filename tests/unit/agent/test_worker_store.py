"""Who hosts the workers' store in restart mode, and the agent-hosted store of elastic rounds."""

from __future__ import annotations

import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from flexrun.agent.worker_store import RoundStores, shares_agent_store
from flexrun.config import RunConfig, StaticJob, StoreSettings
from flexrun.rendezvous.state import MasterRecord, Member, RoundRecord
from flexrun.testing.config import run_config

pytestmark = pytest.mark.timeout(60)


def _config(tmp_path: Path, **kw: object) -> RunConfig:
    script = tmp_path / "s.py"
    script.write_text("")
    return run_config(entrypoint=str(script), nproc_per_node=2, **kw)


def test_restart_mode_shares_an_agent_store_as_torchruns_c10d_handler(tmp_path: Path) -> None:
    assert shares_agent_store(_config(tmp_path))
    off = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    assert not shares_agent_store(_config(tmp_path, environ=off))
    assert shares_agent_store(
        _config(tmp_path, environ={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"})
    )
    # torchrun's etcd handlers do not share their store; live mode has its own group store
    assert not shares_agent_store(_config(tmp_path, store=StoreSettings(backend="etcd")))
    assert not shares_agent_store(_config(tmp_path, mode="live"))
    # a static job's workers always meet in node rank 0's agent store (torchrun's static)
    static = StaticJob(nnodes=2, node_rank=1, master_addr="10.1.2.3", master_port=29500)
    assert shares_agent_store(_config(tmp_path, static=static, environ=off))


def _round(number: int, *ids: str) -> RoundRecord:
    members = tuple(Member(i, "127.0.0.1", 1) for i in ids)
    return RoundRecord(number=number, state="running", members=members)


class Published:
    """The rendezvous side of ``master_for``: the first record of a round wins."""

    def __init__(self) -> None:
        self.records: dict[int, MasterRecord] = {}
        self.listening_when_published: list[bool] = []

    def __call__(self, rnd: RoundRecord, port: int) -> MasterRecord | None:
        if port:
            self.listening_when_published.append(_listens(port))
            self.records.setdefault(rnd.number, MasterRecord("127.0.0.1", port))
        return self.records.get(rnd.number)


def _listens(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_group_rank_0_hosts_a_fresh_store_each_round_before_publishing_it(
    tmp_path: Path,
) -> None:
    pub = Published()
    stores = RoundStores(pub, node_id="a", addr="127.0.0.1")
    try:
        first = stores.for_round(_round(1, "a", "b"))
        assert first is not None and pub.listening_when_published == [True]
        # a worker is a plain client of it (TORCHELASTIC_USE_AGENT_STORE=True in torch)
        client = dist.TCPStore("127.0.0.1", first.port, 2, False, timeout=timedelta(seconds=10))
        client.set("k", b"v")
        assert client.get("k") == b"v"
        del client
        second = stores.for_round(_round(2, "a", "b"))
        assert second is not None and second.port != first.port
        assert not _listens(first.port)  # the old round's keys are gone with their store
        # a round where another node is group rank 0: nothing hosted here, its master used
        pub.records[3] = MasterRecord("127.0.0.1", 1)
        assert stores.for_round(_round(3, "b", "a")) == MasterRecord("127.0.0.1", 1)
        assert not _listens(second.port)
    finally:
        stores.close()


def test_a_master_published_first_by_another_wins_and_ours_is_dropped(tmp_path: Path) -> None:
    pub = Published()
    pub.records[1] = MasterRecord("127.0.0.1", 1)  # e.g. an earlier agent of this node id
    stores = RoundStores(pub, node_id="a", addr="127.0.0.1")
    try:
        assert stores.for_round(_round(1, "a")) == MasterRecord("127.0.0.1", 1)
        assert stores._server is None
    finally:
        stores.close()


def _listening_on(port: int) -> set[str]:
    import psutil

    conns = psutil.Process().net_connections(kind="inet")
    return {c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


def test_the_store_listens_on_the_advertised_address_only_where_it_can() -> None:
    # a one-host job advertises loopback: nothing beyond this host can reach its store
    local = RoundStores(Published(), node_id="a", addr="127.0.0.1")
    # an address that is not this host's (TEST-NET-1, behind NAT, say): every interface
    foreign = RoundStores(Published(), node_id="a", addr="192.0.2.1")
    try:
        mine = local.for_round(_round(1, "a"))
        assert mine is not None and _listening_on(mine.port) == {"127.0.0.1"}
        other = foreign.for_round(_round(1, "a"))
        assert other is not None and _listening_on(other.port) & {"::", "0.0.0.0"}
    finally:
        local.close()
        foreign.close()


def test_a_static_rounds_store_keeps_the_jobs_records_and_drops_the_workers_keys() -> None:
    # One server, as a static job's node rank 0 hosts at the master port: flexrun's records
    # (and its protocol's own keys) stay; every key of a dead world's workers goes.
    from flexrun.store.factory import delete_all_but
    from flexrun.store.tcp import TcpStore, TcpStoreServer

    server = TcpStoreServer("127.0.0.1", 0)
    store = TcpStore("127.0.0.1", server.port, connect_timeout_s=10)
    try:
        store.put("flexrun/none/s/round/current", b"round")
        worker = dist.TCPStore("127.0.0.1", server.port, 2, False, timeout=timedelta(seconds=10))
        worker.set("default_pg/0//cpu//0/1", b"127.0.0.1:4242")
        worker.set("\xff-user-key", b"x")
        del worker
        assert delete_all_but(store, "flexrun/") >= 2
        left = dist.TCPStore("127.0.0.1", server.port, None, False, timedelta(seconds=10))
        keys = set(left.list_keys())
        assert not any(k.startswith("default_pg/") or k.startswith("\xff-") for k in keys), keys
        assert "init/" not in keys  # (the workers' own counter, torch's TCPStore's)
        entry = store.get("flexrun/none/s/round/current")
        assert entry is not None and entry.value == b"round"
        assert any(k.startswith("__flexrun/") for k in keys)
        with pytest.raises(ValueError):
            delete_all_but(store, "")
    finally:
        store.close()
        server.close()
