"""``SLURM_*`` -> ``flexrun run`` defaults (issue 37): what ``srun flexrun run train.py``
means with nothing else, and that the command line and ``PET_*`` still win."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
from collections.abc import Mapping
from pathlib import Path

import pytest

from flexrun.agent.spec import apply_settings
from flexrun.cli import build_parser
from flexrun.config import RunConfig, run_config_from_args
from flexrun.config.slurm import PORT_BASE, expand_hostlist, step_of, tasks_per_node
from flexrun.errors import ConfigError


@pytest.fixture
def script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")
    return "train.py"


@pytest.fixture(autouse=True)
def no_dns(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Slurm host names here (gpu07) exist nowhere: fail their look-up at once instead
    of waiting for this machine's resolver to time out."""
    real = socket.getaddrinfo

    def lookup(host: object, *args: object, **kw: object) -> object:
        if isinstance(host, str) and host.startswith("gpu"):
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return real(host, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(socket, "getaddrinfo", lookup)


def cfg(argv: list[str], env: Mapping[str, str]) -> RunConfig:
    env = dict(env)
    ns = build_parser(env).parse_args(["run", *argv])
    return run_config_from_args(ns, env)


def step_env(rank: int = 1, nodes: int = 2, job: str = "4711", **extra: str) -> dict[str, str]:
    """What ``srun`` gives a task of a ``-N nodes --ntasks-per-node=1`` step (22.05)."""
    env = {
        "SLURM_JOB_ID": job,
        "SLURM_JOBID": job,
        "SLURM_NNODES": str(nodes),
        "SLURM_JOB_NUM_NODES": str(nodes),
        "SLURM_NODEID": str(rank),
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": "0",
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NUM_NODES": str(nodes),
        "SLURM_STEP_NUM_TASKS": str(nodes),
        "SLURM_NTASKS": str(nodes),
        "SLURM_JOB_NODELIST": f"gpu[07-{7 + nodes - 1:02d}]",
        "SLURM_STEP_NODELIST": f"gpu[07-{7 + nodes - 1:02d}]",
        # (no PATH: no scontrol, flexrun's own hostlist parser answers)
    }
    env.update(extra)
    return env


# -- hostlists ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("n1", ["n1"]),
        ("n[1-3,5],gpu01", ["n1", "n2", "n3", "n5", "gpu01"]),
        ("gpu[07-10]", ["gpu07", "gpu08", "gpu09", "gpu10"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("a,b[2],c", ["a", "b2", "c"]),
        ("node[0009-0011].x", ["node0009.x", "node0010.x", "node0011.x"]),
    ],
)
def test_hostlists_expand_as_slurm_does(text: str, hosts: list[str]) -> None:
    assert expand_hostlist(text) == hosts


@pytest.mark.skipif(
    shutil.which("scontrol") is None, reason="scontrol (slurm-client) not installed"
)
def test_the_parser_agrees_with_scontrol(tmp_path: Path) -> None:
    conf = tmp_path / "slurm.conf"
    conf.write_text(
        "ClusterName=x\nSlurmctldHost=localhost\nNodeName=n1\nPartitionName=p Nodes=n1\n"
    )
    for text in ("n[1-3,5],gpu01", "gpu[07-10]", "rack[1-2]-n[01-02]", "a,b[2],c", "x[098-101]"):
        done = subprocess.run(
            ["scontrol", "show", "hostnames", text],
            capture_output=True,
            text=True,
            timeout=30,
            env={"SLURM_CONF": str(conf), "PATH": os.environ.get("PATH", "")},
            check=True,
        )
        assert expand_hostlist(text) == done.stdout.split(), text


@pytest.mark.parametrize("text", ["n[1-3", "n1-3]", "n[3-1]", "n[a-b]", "n[1-2]x]"])
def test_bad_hostlists_are_one_clear_error(text: str) -> None:
    with pytest.raises(ConfigError, match="hostlist"):
        expand_hostlist(text)


# -- the static form ---------------------------------------------------------------------------
def test_srun_flexrun_run_alone_is_a_static_job_over_the_steps_nodes(script: str) -> None:
    c = cfg([script], step_env(rank=1))
    assert c.static is not None
    assert (c.static.nnodes, c.static.node_rank) == (2, 1)
    assert c.static.master_addr == "gpu07"
    assert c.static.master_port == PORT_BASE + 2 * 4711
    assert c.rendezvous.min_nodes == c.rendezvous.max_nodes == 2
    assert c.run_id == "slurm-4711"
    assert c.output.run_dir == (Path("flexrun-runs") / "slurm-4711").absolute()
    assert not c.store.host_store
    assert cfg([script], step_env(rank=0)).store.host_store  # rank 0 hosts the store


def test_consecutive_jobs_ports_do_not_meet(script: str) -> None:
    # A static job takes its master port alone (store_port is the master port).
    a = cfg([script], step_env(job="19")).static
    b = cfg([script], step_env(job="20")).static
    assert a is not None and b is not None
    assert {a.master_port, a.store_port}.isdisjoint({b.master_port, b.store_port})


def test_an_array_tasks_run_id_names_the_array_and_the_task(script: str) -> None:
    env = step_env(job="900", SLURM_ARRAY_JOB_ID="899", SLURM_ARRAY_TASK_ID="3")
    assert cfg([script], env).run_id == "slurm-899_3"


def test_cli_and_pet_win_over_slurm(script: str) -> None:
    c = cfg(["--master-port", "29555", "--rdzv-id", "mine", script], step_env(rank=1))
    assert c.static is not None and c.static.master_port == 29555 and c.run_id == "mine"
    env = step_env(rank=1, PET_MASTER_ADDR="10.0.0.9", PET_NODE_RANK="0")
    c = cfg([script], env)
    assert c.static is not None
    assert (c.static.master_addr, c.static.node_rank, c.static.nnodes) == ("10.0.0.9", 0, 2)


# -- the elastic form --------------------------------------------------------------------------
def test_nnodes_min_max_is_elastic_over_c10d_on_the_head_node(script: str) -> None:
    c = cfg(["--nnodes", "1:2", script], step_env(rank=1))
    assert c.static is None
    assert c.store.backend == "c10d"
    assert c.store.endpoints == (("gpu07", PORT_BASE + 2 * 4711),)
    assert (c.rendezvous.min_nodes, c.rendezvous.max_nodes) == (1, 2)
    assert c.run_id == "slurm-4711"


def test_an_endpoint_given_is_elastic_with_the_allocations_size(script: str) -> None:
    c = cfg(["--rdzv-endpoint", "127.0.0.1:29999", script], step_env(rank=1))
    assert c.static is None and c.store.endpoints == (("127.0.0.1", 29999),)
    assert (c.rendezvous.min_nodes, c.rendezvous.max_nodes) == (1, 2)
    # The step's two tasks start together: the first round waits for both, at most 30 s
    # after the last arrival (a quarter of a shorter join timeout: followers give up then).
    assert (c.rendezvous.expected_nodes, c.rendezvous.expected_wait_s) == (2, 30.0)
    short = cfg(["--rdzv-conf", "join_timeout=20", "--nnodes", "1:2", script], step_env(rank=1))
    assert short.rendezvous.expected_wait_s == 5.0


def test_a_max_below_the_steps_tasks_leaves_spare_nodes(script: str) -> None:
    # 3 tasks, --nnodes 1:2: two train, the third agent waits on standby as a spare node.
    c = cfg(["--nnodes", "1:2", script], step_env(rank=2, nodes=3))
    assert c.static is None and c.store.endpoints == (("gpu07", PORT_BASE + 2 * 4711),)
    assert (c.rendezvous.min_nodes, c.rendezvous.max_nodes) == (1, 2)
    assert c.rendezvous.expected_nodes == 2  # (MAX: the third is a spare node)


def test_a_static_node_count_below_the_steps_tasks_is_refused(script: str) -> None:
    with pytest.raises(ConfigError, match="--nnodes MIN:2 to keep 1 of them as spare"):
        cfg(["--nnodes", "2", script], step_env(nodes=3))


# -- what must never happen: a multi-node job training as independent one-node jobs ------------
def test_a_batch_script_of_a_multi_node_job_is_refused(script: str) -> None:
    env = step_env(rank=0)
    del env["SLURM_STEP_ID"]  # the batch script (and an salloc shell) run outside any step
    with pytest.raises(ConfigError, match="srun --ntasks-per-node=1"):
        cfg([script], env)


def test_a_batch_script_of_a_one_node_job_runs_here_with_the_jobs_id(script: str) -> None:
    env = step_env(rank=0, nodes=1)
    del env["SLURM_STEP_ID"]
    c = cfg([script], env)
    assert c.static is None and c.rendezvous.max_nodes == 1


def test_standalone_in_a_multi_task_step_is_refused(script: str) -> None:
    with pytest.raises(ConfigError, match="independent one-node jobs"):
        cfg(["--standalone", script], step_env(rank=1))


def test_a_one_task_step_is_one_host_with_the_jobs_id(script: str) -> None:
    c = cfg([script], step_env(rank=0, nodes=1))
    assert c.static is None and c.store.endpoints == () and c.run_id == "slurm-4711"


def test_flexrun_slurm_0_ignores_the_slurm_variables(script: str) -> None:
    c = cfg([script], step_env(rank=1, FLEXRUN_SLURM="0"))
    assert c.static is None and c.run_id.startswith("local-")


def test_a_rank_outside_the_step_is_refused() -> None:
    with pytest.raises(ConfigError, match="SLURM_PROCID=5"):
        step_of(step_env(rank=5))


def test_outside_slurm_nothing_changes(script: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    c = cfg([script], {})
    assert c.static is None and c.run_id.startswith("local-")
    assert c.rendezvous.expected_nodes == 0  # (nobody known to be starting with it)


# -- one task per GPU --------------------------------------------------------------------------
def per_gpu_env(procid: int, **extra: str) -> dict[str, str]:
    """A task of ``srun -N2 --ntasks-per-node=2`` (block distribution: 0, 1 on gpu07)."""
    return step_env(
        rank=procid,
        SLURM_NODEID=str(procid // 2),
        SLURM_LOCALID=str(procid % 2),
        SLURM_STEP_NUM_TASKS="4",
        SLURM_NTASKS="4",
        SLURM_STEP_TASKS_PER_NODE="2(x2)",
        **extra,
    )


@pytest.mark.parametrize(
    ("text", "counts"), [("1", [1]), ("2(x3),1", [2, 2, 2, 1]), ("8(x2)", [8, 8]), ("", [])]
)
def test_tasks_per_node_expand_as_slurm_writes_them(text: str, counts: list[int]) -> None:
    assert tasks_per_node(text) == counts


def test_tasks_per_node_in_another_syntax_is_refused() -> None:
    with pytest.raises(ConfigError, match="SLURM_STEP_TASKS_PER_NODE"):
        tasks_per_node("2x3")


def test_one_task_per_gpu_takes_rank_and_local_rank_from_the_task(script: str) -> None:
    c = cfg(["--nproc-per-node", "1", script], per_gpu_env(3))
    assert c.static is not None and (c.static.nnodes, c.static.node_rank) == (4, 3)
    assert c.worker.slurm_task == (1, 2)
    env: dict[str, str] = {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    apply_settings(env, c, 0)
    assert (env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("1", "2")


def test_a_task_bound_to_one_gpu_sees_it_as_local_rank_0(script: str) -> None:
    c = cfg(["--nproc-per-node", "1", script], per_gpu_env(3, CUDA_VISIBLE_DEVICES="3"))
    env: dict[str, str] = {}
    apply_settings(env, c, 0)
    assert (env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("0", "2")


def test_several_workers_per_task_keep_the_agents_local_ranks(script: str) -> None:
    assert cfg(["--nproc-per-node", "2", script], per_gpu_env(1)).worker.slurm_task is None
    assert cfg([script], step_env(rank=1)).worker.slurm_task is None  # one task per node
