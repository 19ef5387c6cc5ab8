"""From torchrun command lines (and PET_* environments) to RunConfig: what each one means."""

from __future__ import annotations

import logging
import signal
import textwrap
from collections.abc import Mapping
from pathlib import Path

import pytest

from flexrun.cli import build_parser
from flexrun.config import RunConfig, run_config_from_args
from flexrun.errors import ConfigError


@pytest.fixture
def script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")
    return "train.py"


def cfg(argv: list[str], env: Mapping[str, str] | None = None) -> RunConfig:
    env = dict(env or {})
    ns = build_parser(env).parse_args(["run", *argv])
    return run_config_from_args(ns, env)


# -- the job's shape ----------------------------------------------------------------------


def test_default_single_node_is_a_local_store_like_torchruns_localhost_0(script: str) -> None:
    c = cfg([script])
    assert c.static is None and c.store.endpoints == () and c.store.host_store
    assert c.rendezvous.min_nodes == c.rendezvous.max_nodes == 1
    assert c.run_id.startswith("local-")


def test_static_job_from_flags(script: str) -> None:
    c = cfg(["--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1",
             "--master-port", "29511", "--nproc-per-node", "2", script])  # fmt: skip
    assert c.static is not None
    assert (c.static.nnodes, c.static.node_rank) == (2, 1)
    assert (c.static.master_addr, c.static.master_port) == ("127.0.0.1", 29511)
    assert not c.static.hosts_store and not c.store.host_store
    # One port, as torchrun's: flexrun's store is the workers' store, at the master port.
    assert c.store.backend == "static" and c.store.endpoints == (("127.0.0.1", 29511),)
    assert c.rendezvous.min_nodes == c.rendezvous.max_nodes == 2
    assert c.run_id == "none"  # torchrun's default id


def test_static_job_from_the_five_trainer_v2_variables(script: str) -> None:
    env = {
        "PET_NNODES": "2",
        "PET_NPROC_PER_NODE": "3",
        "PET_NODE_RANK": "0",
        "PET_MASTER_ADDR": "127.0.0.1",
        "PET_MASTER_PORT": "29512",
    }
    c = cfg([script], env)
    assert c.static is not None and c.static.hosts_store and c.store.host_store
    assert (c.static.nnodes, c.static.master_port, c.worker.nproc_per_node) == (2, 29512, 3)
    assert c.rendezvous.static and c.rendezvous.min_nodes == c.rendezvous.max_nodes == 2


def test_nnodes_above_one_without_master_port_is_static_on_29500(script: str) -> None:
    c = cfg(["--nnodes", "2", script])
    assert c.static is not None and c.static.master_port == 29500


def test_one_node_with_a_master_port_is_a_static_job_there(script: str) -> None:
    c = cfg(["--master-port", "29513", script])
    assert c.static is not None and c.static.nnodes == 1 and c.static.master_port == 29513


def test_explicit_static_backend_uses_the_endpoint_as_master(script: str) -> None:
    c = cfg(["--rdzv-backend", "static", "--nnodes", "2", "--node-rank", "1",
             "--rdzv-endpoint", "127.0.0.1:29514", script])  # fmt: skip
    assert c.static is not None and c.static.master_port == 29514 and c.static.node_rank == 1


def test_an_endpoint_makes_it_elastic_and_static_pet_values_are_ignored(
    script: str, caplog: pytest.LogCaptureFixture
) -> None:
    env = {"PET_NODE_RANK": "1", "PET_MASTER_ADDR": "10.9.9.9", "PET_MASTER_PORT": "1"}
    with caplog.at_level(logging.INFO, logger="flexrun.config"):
        c = cfg(["--nnodes", "1:3", "--rdzv-backend", "c10d",
                 "--rdzv-endpoint", "127.0.0.1:29515", "--rdzv-id", "j", script], env)  # fmt: skip
    assert c.static is None and c.store.backend == "c10d"
    assert c.store.endpoints == (("127.0.0.1", 29515),)
    assert (c.rendezvous.min_nodes, c.rendezvous.max_nodes) == (1, 3)
    lines = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert len(lines) == 1 and "--node-rank/--master-addr/--master-port" in lines[0]


def test_an_endpoint_with_torchruns_default_backend_is_elastic_c10d(script: str) -> None:
    c = cfg(["--nnodes", "1:2", "--rdzv-endpoint", "127.0.0.1:29516", script])
    assert c.static is None and c.store.backend == "c10d"


def test_static_node_rank_out_of_range_is_refused(script: str) -> None:
    with pytest.raises(ConfigError, match=r"--node-rank 2: must be 0\.\.1"):
        cfg(["--nnodes", "2", "--node-rank", "2", script])


def test_c10d_without_endpoint_uses_torchruns_localhost_29400(script: str) -> None:
    c = cfg(["--rdzv-backend", "c10d", "--nnodes", "2", script])
    assert c.store.endpoints == (("localhost", 29400),) and c.store.host_store


def test_port_zero_means_a_free_port_here(script: str) -> None:
    c = cfg(["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", script])
    assert c.store.endpoints == () and c.store.host_store
    with pytest.raises(ConfigError, match="port 0 means a free port on this machine"):
        cfg(["--rdzv-backend", "c10d", "--rdzv-endpoint", "192.0.2.77:0", script])


def test_standalone_overrides_the_rendezvous_flags(script: str) -> None:
    c = cfg(["--standalone", "--rdzv-backend", "etcd", "--rdzv-endpoint", "x:1", script])
    assert (
        c.store.backend == "c10d" and c.store.endpoints == () and c.run_id.startswith("standalone-")
    )
    with pytest.raises(ConfigError, match="--standalone runs one node"):
        cfg(["--standalone", "--nnodes", "2", script])


def test_etcd_v2_backend_is_flexruns_etcd_and_its_keys_are_mapped(script: str) -> None:
    c = cfg(["--rdzv-backend", "etcd-v2", "--rdzv-endpoint", "e1:2379,e2:2379",
             "--rdzv-conf", "protocol=https,ssl_cert=c.pem,ssl_cert_key=k.pem,ca_cert=ca.pem,"
             "read_timeout=7,etcd_prefix=/p,timeout=30", script])  # fmt: skip
    assert c.store.backend == "etcd"
    assert dict(c.store.conf) == {
        "tls": "true",
        "cert": "c.pem",
        "key": "k.pem",
        "cacert": "ca.pem",
        "request_timeout": "7.0",
    }
    assert c.rendezvous.join_timeout_s == 30.0
    assert c.store.endpoints == (("e1", 2379), ("e2", 2379))


def test_torchruns_etcd_v1_keys_pass_through(script: str) -> None:
    c = cfg(["--rdzv-backend", "etcd", "--rdzv-endpoint", "e:2379",
             "--rdzv-conf", "protocol=https,cert=c,key=k,cacert=ca,last_call_timeout=3", script])  # fmt: skip
    assert dict(c.store.conf) == {"tls": "true", "cert": "c", "key": "k", "cacert": "ca"}
    assert c.rendezvous.last_call_s == 3.0


def test_torchruns_c10d_keys_map_onto_flexruns_settings(script: str) -> None:
    c = cfg(["--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29517",
             "--rdzv-conf", "keep_alive_interval=2,keep_alive_max_attempt=4,read_timeout=9,"
             "join_timeout=11,last_call_timeout=0,close_timeout=5,is_host=0", script])  # fmt: skip
    r = c.rendezvous
    assert (r.heartbeat_interval_s, r.heartbeat_timeout_s) == (2.0, 8.0)
    assert (r.join_timeout_s, r.last_call_s) == (11.0, 0.0)
    assert c.store.op_timeout_s == 9.0 and not c.store.host_store and dict(c.store.conf) == {}


def test_an_unknown_rdzv_conf_key_warns_once_naming_it(
    script: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="flexrun.config"):
        cfg(["--rdzv-conf", "join_timout=5", script])
    hits = [r for r in caplog.records if "join_timout" in r.getMessage()]
    assert len(hits) == 1 and "unknown key" in hits[0].getMessage()


@pytest.mark.parametrize(
    "conf",
    ["heartbeat_interval=nan", "join_timeout=inf", "last_call_timeout=-1", "read_timeout=0",
     "keep_alive_max_attempt=0", "store_type=file", "protocol=ftp", "is_host=maybe",
     "keep_alive_interval=2,heartbeat_interval=3"],
)  # fmt: skip
def test_bad_rdzv_conf_values_are_refused(script: str, conf: str) -> None:
    with pytest.raises(ConfigError, match="--rdzv-conf"):
        cfg(["--rdzv-backend", "etcd", "--rdzv-endpoint", "e:1", "--rdzv-conf", conf, script])


# -- values -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--monitor-interval", "nan"], "--monitor-interval"),
        (["--monitor-interval", "-1"], "--monitor-interval"),
        (["--stop-grace", "inf"], "--stop-grace"),
        (["--shutdown-timeout", "-3"], "--shutdown-timeout"),
        (["--hang-timeout", "nan"], "--hang-timeout"),
        (["--resource-interval", "-inf"], "--resource-interval"),
        (["--shutdown-timeout", "5", "--stop-grace", "6"], "same setting"),
        (["--module", "--no-python"], "cannot be used together"),
        (["--event-log-handler", "scribe"], "--event-log-handler 'scribe'"),
        (["--logs-specs", "nope"], "torchrun.logs_specs:nope"),
        (["--local-ranks-filter", "0,x"], "--local-ranks-filter"),
        (["-t", "0:4"], "-t"),
        (["--rdzv-backend", "zookeeper"], "zookeeper"),
        (["--numa-binding", "node"], "--numa-binding node"),
    ],
)
def test_bad_values_are_one_clear_error(script: str, argv: list[str], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        cfg([*argv, script])
    assert needle in str(info.value)


def test_monitor_interval_zero_is_accepted_as_often_as_possible(script: str) -> None:
    assert cfg(["--monitor-interval", "0", script]).worker.monitor_interval_s == 0.01


def test_shutdown_timeout_precedence(script: str) -> None:
    assert cfg([script]).worker.stop_grace_s == 30.0
    assert cfg([script], {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "7"}).worker.stop_grace_s == 7.0
    env = {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "7", "PET_SHUTDOWN_TIMEOUT": "4"}
    assert cfg([script], env).worker.stop_grace_s == 4.0
    assert cfg(["--shutdown-timeout", "2", script], env).worker.stop_grace_s == 2.0
    assert cfg(["--stop-grace", "1.5", script]).worker.stop_grace_s == 1.5


def test_run_dir_or_log_dir_naming_a_file_is_refused(script: str, tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError, match="--run-dir .*afile: names a file"):
        cfg(["--run-dir", "afile", script])
    with pytest.raises(ConfigError, match="--log-dir .*: is below .*afile, a file"):
        cfg(["--log-dir", "afile/logs", script])


def test_run_path_wins_over_module_and_no_python(script: str) -> None:
    c = cfg(["--run-path", "--no-python", script])
    assert c.worker.run_path and not c.worker.no_python and not c.worker.module


def test_per_rank_redirects_tee_and_filter(script: str) -> None:
    c = cfg(["-r", "0:1,1:3", "-t", "1:2", "--local-ranks-filter", "0,1", "--nproc-per-node",
             "3", script])  # fmt: skip
    assert c.output.console_for(0) == {"stderr"}
    assert c.output.console_for(1) == {"stderr"}  # redirected both, but stderr tee'd
    assert c.output.console_for(2) == frozenset()  # filtered out
    assert c.output.redirects.of(2) == frozenset() and c.output.tee.of(0) == frozenset()
    plain = cfg(["-r", "1", script])
    assert plain.output.console_streams == {"stderr"} and plain.output.console_for(0) == {"stderr"}


def test_torchrun_only_settings_are_carried(script: str) -> None:
    c = cfg(["--signals-to-handle", "SIGTERM,SIGUSR1,SIGKILL,NOPE", "--start-method", "fork",
             "--virtual-local-rank", "--duplicate-stdout-filters", "a,,b,c",
             "--event-log-handler", "console", "--metrics-host", "0.0.0.0", script],
            {"PYTHON_EXEC": "/usr/bin/python3", "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "${rank}>",
             "TORCHELASTIC_ERROR_FILE": "/tmp/e.json"})  # fmt: skip
    assert c.worker.signals_to_handle == ("SIGTERM", "SIGUSR1", "SIGKILL", "NOPE")
    assert c.worker.signal_numbers == (signal.SIGTERM, signal.SIGUSR1)
    assert c.worker.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGTERM,SIGUSR1,SIGKILL,NOPE"
    assert c.worker.start_method == "fork" and c.worker.virtual_local_rank
    assert c.output.duplicate_stdout_filters == ("a,b", "c") and c.output.event_log_handler == "console"
    assert c.worker.python_exec == "/usr/bin/python3" and c.output.log_line_prefix_template == "${rank}>"
    assert c.output.launcher_error_file == Path("/tmp/e.json") and c.observe.metrics_host == "0.0.0.0"
    assert cfg([script]).observe.metrics_host == "127.0.0.1"


def _plugin_dist(root: Path, group: str, name: str, value: str) -> None:
    info = root / "fakeplugin-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fakeplugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[{group}]\n{name} = {value}\n")


def test_logs_specs_entry_point_is_found_and_the_agent_loads_and_checks_it(
    script: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flexrun.agent.logs_specs import load_logs_specs

    site = tmp_path / "site"
    _plugin_dist(site, "torchrun.logs_specs", "mine", "fakeplugin_mod:Specs")
    (site / "fakeplugin_mod.py").write_text(
        textwrap.dedent(
            """
            from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
            class Specs(DefaultLogsSpecs):
                pass
            class NotSpecs:
                pass
            """
        )
    )
    monkeypatch.syspath_prepend(str(site))
    c = cfg(["--logs-specs", "mine", "--log-dir", str(tmp_path / "logs"), script])
    assert c.output.logs_specs == "mine"
    specs = load_logs_specs(c.output)
    assert type(specs).__name__ == "Specs" and specs.root_log_dir == str(tmp_path / "logs")
    assert load_logs_specs(cfg([script]).output) is None
    (site / "fakeplugin-1.0.dist-info" / "entry_points.txt").write_text(
        "[torchrun.logs_specs]\nmine = fakeplugin_mod:NotSpecs\nother = nomodule:X\n"
    )
    with pytest.raises(ConfigError, match="not a LogsSpecs subclass"):
        load_logs_specs(cfg(["--logs-specs", "mine", script]).output)
    with pytest.raises(ConfigError, match="cannot load nomodule:X .ModuleNotFoundError"):
        load_logs_specs(cfg(["--logs-specs", "other", script]).output)
    with pytest.raises(ConfigError, match="names: .*mine, other"):
        cfg(["--logs-specs", "nope", script])


def test_a_torchrun_rendezvous_plugin_is_refused_naming_it(
    script: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _plugin_dist(tmp_path / "site", "torchrun.handlers", "zk", "zkplug:handler")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    with pytest.raises(ConfigError, match="torchrun rendezvous plugin .*zkplug:handler"):
        cfg(["--rdzv-backend", "zk", "--rdzv-endpoint", "h:1", script])


def test_virtual_local_rank_needs_a_device_per_worker(script: str) -> None:
    with pytest.raises(ConfigError, match="CUDA_VISIBLE_DEVICES"):
        cfg(
            ["--virtual-local-rank", "--nproc-per-node", "3", script],
            {"CUDA_VISIBLE_DEVICES": "4,5"},
        )
