"""Which address a node advertises, and the worker environment built from it."""

from __future__ import annotations

from pathlib import Path

import pytest

from flexrun.agent.spec import worker_envs
from flexrun.config import RunConfig
from flexrun.config.netaddr import (
    choose_advertised,
    interface_of,
    is_loopback_literal,
    route_source,
    single_host_addr,
)
from flexrun.errors import ConfigError
from flexrun.rendezvous.state import MasterRecord, Member, RoundRecord
from flexrun.testing.config import run_config

TABLE = {"lo": ["127.0.0.1", "::1"], "eth7": ["10.1.2.3"], "ib0": ["10.9.0.3"]}


def _route(table: dict[str, str]):
    return lambda host, port: table.get(host)


def test_loopback_literals() -> None:
    for host in ("localhost", "127.0.0.1", "127.0.1.1", "::1", "[::1]"):
        assert is_loopback_literal(host)
    for host in ("10.0.0.1", "node1", "0.0.0.0"):
        assert not is_loopback_literal(host)


def test_the_route_toward_the_store_decides_the_address_and_interface() -> None:
    a = choose_advertised("10.9.0.1", 29400, route=_route({"10.9.0.1": "10.9.0.3"}), table=TABLE)
    assert (a.addr, a.ifname, a.multi_host) == ("10.9.0.3", "ib0", True)


def test_a_store_name_resolving_to_loopback_here_falls_back_to_the_default_route() -> None:
    routes = {"node1": "127.0.1.1", "198.51.100.1": "10.1.2.3"}
    a = choose_advertised("node1", 29400, route=_route(routes), table=TABLE)
    assert (a.addr, a.ifname) == ("10.1.2.3", "eth7")


def test_only_a_loopback_address_for_peers_on_other_hosts_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"would advertise 127\.0\.1\.1 \(a loopback address\)"):
        choose_advertised("node1", 29400, route=_route({"node1": "127.0.1.1"}), table=TABLE)
    with pytest.raises(ConfigError, match="no route from this node toward 10.250.0.1"):
        choose_advertised("10.250.0.1", 1, route=_route({}), table=TABLE)


def test_an_explicit_loopback_local_addr_with_a_remote_store_is_refused() -> None:
    with pytest.raises(ConfigError, match="--local-addr 127.0.0.1: a loopback address"):
        choose_advertised("192.0.2.77", 29400, explicit="127.0.0.1", table=TABLE)
    a = choose_advertised("192.0.2.77", 29400, explicit="10.1.2.3", table=TABLE)
    assert (a.addr, a.ifname) == ("10.1.2.3", "eth7")


def test_a_one_host_job_advertises_torchruns_fqdn_when_it_is_this_machine() -> None:
    a = choose_advertised(None, single_host=lambda: "localhost")
    assert (a.addr, a.ifname, a.multi_host) == ("localhost", None, False)
    assert single_host_addr(lambda: "localhost") == "localhost"
    assert single_host_addr(lambda: "host.invalid") == "127.0.0.1"


def test_real_lookups_on_this_machine() -> None:
    assert route_source("127.0.0.1") == "127.0.0.1"
    assert interface_of("127.0.0.1") == "lo"
    assert route_source("name.invalid") is None


def _envs(
    settings: RunConfig | None, base: dict[str, str] | None = None, *, agent_store: bool = False
) -> list[dict[str, str]]:
    rnd = RoundRecord(number=1, state="running", members=(Member("n", "10.1.2.3", 2),))
    return worker_envs(
        base=base or {},
        rnd=rnd,
        node_id="n",
        nproc=2,
        master=MasterRecord("10.1.2.3", 1234),
        role="default",
        run_id="r",
        run_dir=Path("/tmp/r"),
        restart_count=0,
        max_restarts=0,
        settings=settings,
        agent_store=agent_store,
    )


def _settings(tmp_path: Path, **kw: object) -> RunConfig:
    script = tmp_path / "s.py"
    script.write_text("")
    return run_config(entrypoint=str(script), nproc_per_node=2, **kw)


def test_worker_env_gets_the_interface_unless_the_user_chose_one(tmp_path: Path) -> None:
    s = _settings(tmp_path, socket_ifname="eth7")
    env = _envs(s)[0]
    assert env["GLOO_SOCKET_IFNAME"] == "eth7" and env["NCCL_SOCKET_IFNAME"] == "=eth7"
    mine = _envs(s, {"GLOO_SOCKET_IFNAME": "ib0"})[1]
    assert mine["GLOO_SOCKET_IFNAME"] == "ib0" and mine["NCCL_SOCKET_IFNAME"] == "=eth7"
    assert "GLOO_SOCKET_IFNAME" not in _envs(_settings(tmp_path))[0]
    assert "GLOO_SOCKET_IFNAME" not in _envs(None)[0]


def test_worker_env_signals_and_virtual_local_rank(tmp_path: Path) -> None:
    s = _settings(
        tmp_path,
        virtual_local_rank=True,
        environ={"CUDA_VISIBLE_DEVICES": "4,6"},
    )
    envs = _envs(s)
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "0"]
    assert [e["RANK"] for e in envs] == ["0", "1"]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["4", "6"]
    plain = _envs(_settings(tmp_path, virtual_local_rank=True))
    assert [e["CUDA_VISIBLE_DEVICES"] for e in plain] == ["0", "1"]


def test_numa_cpu_sets_come_from_torchs_choice_per_local_rank(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch
    from torch.numa import binding

    from flexrun.config import numa

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    seen = []

    def fake(*, gpu_index: int, numa_options: object) -> set[int]:  # torch 2.13's signature
        seen.append((gpu_index, numa_options.affinity_mode.value))  # type: ignore[attr-defined]
        return {gpu_index * 4, gpu_index * 4 + 1}

    monkeypatch.setattr(binding, "_get_logical_cpus_to_bind_to", fake)
    assert numa.cpus_per_local_rank("socket", 2) == (frozenset({0, 1}), frozenset({4, 5}))
    assert seen == [(0, "socket"), (1, "socket")]
    with pytest.raises(ConfigError, match="3 workers but 2 visible GPUs"):
        numa.cpus_per_local_rank("node", 3)
    assert numa.ranges(frozenset({0, 1, 2, 5, 7, 8})) == "0-2,5,7-8"


def test_a_static_job_gives_workers_torchruns_agent_store_view(tmp_path: Path) -> None:
    from flexrun.config import StaticJob

    static = StaticJob(nnodes=2, node_rank=0, master_addr="10.1.2.3", master_port=29500)
    env = _envs(_settings(tmp_path, static=static), agent_store=True)[1]
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.1.2.3", "1234")  # the given master
    assert _envs(_settings(tmp_path))[0]["TORCHELASTIC_USE_AGENT_STORE"] == "False"
