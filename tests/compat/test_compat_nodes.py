"""Several agents ("nodes") on this host: elastic c10d, static flags, Trainer v2's PET_*.

Ports torch's ``test_launch_elastic_multiple_agents`` and ``caffe2_bc`` (static
``--master-addr/--master-port``) cases and issue 21's static multi-node items. Workers
train a few gloo all-reduce steps, so the world really forms.
"""

from __future__ import annotations

import time

import pytest
from compat_checks import same_env, succeeded
from compat_support import Case, Runner, finish, kill_tree, start, wait_for_probes

TRAIN = ("--train", "3")

ELASTIC = Case(
    "two_agents_elastic_c10d",
    ("--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
     "--rdzv-endpoint", "127.0.0.1:{port}", "--rdzv-id", "two", "--rdzv-conf", "last_call_timeout=1"),
    script_args=TRAIN,
    nodes=((), ()),
)  # fmt: skip
STATIC_FLAGS = Case(
    "two_agents_static_flags",
    ("--nnodes=2", "--nproc_per_node=1", "--master_addr=127.0.0.1", "--master_port={port}"),
    script_args=TRAIN,
    nodes=(("--node_rank=0",), ("--node_rank=1",)),
)
STATIC_PET = Case(
    "two_agents_trainer_v2_pet",
    (),
    script_args=TRAIN,
    env={"PET_NNODES": "2", "PET_NPROC_PER_NODE": "1", "PET_MASTER_ADDR": "127.0.0.1",
         "PET_MASTER_PORT": "{port}"},
    nodes=((), ()),
    node_env=({"PET_NODE_RANK": "0"}, {"PET_NODE_RANK": "1"}),
)  # fmt: skip
STATIC_PET_SQUATTED = Case(
    "two_agents_trainer_v2_pet_next_port_taken",
    (),
    script_args=TRAIN,
    env=STATIC_PET.env,
    nodes=((), ()),
    node_env=STATIC_PET.node_env,
    squat_next_port=True,  # issue 33: both launchers need the master port only
)
STATIC_ONE = Case(
    "one_node_static_master_port",
    ("--nnodes=1", "--nproc_per_node=2", "--monitor_interval=1", "--start_method=spawn",
     "--master_addr=localhost", "--master_port={port}", "--node_rank=0"),
    script_args=TRAIN,
)  # fmt: skip
EXPLICIT_STATIC = Case(
    "two_agents_explicit_static_endpoint",
    ("--rdzv-backend", "static", "--rdzv-endpoint", "127.0.0.1:{port}", "--nnodes", "2"),
    script_args=TRAIN,
    nodes=(("--node-rank", "0"), ("--node-rank", "1")),
)

TRAINS = [ELASTIC, STATIC_FLAGS, STATIC_PET, STATIC_PET_SQUATTED, STATIC_ONE, EXPLICIT_STATIC]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", TRAINS, ids=[c.name for c in TRAINS])
def test_the_world_forms_and_trains(runner: Runner, case: Case) -> None:
    runs = runner(case)
    succeeded(runs)
    for run in runs.values():
        lines = sorted(ln for ln in run.bare_worker_lines() if ln.startswith("trained"))
        world = len(run.probes)
        assert lines == sorted(f"trained 3 world {world} rank {r}" for r in range(world))


@pytest.mark.timeout(300)
def test_elastic_agents_see_the_same_environment(runner: Runner) -> None:
    same_env(runner(ELASTIC), 2, run_id="two")


STATIC = [STATIC_FLAGS, STATIC_PET, EXPLICIT_STATIC]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", STATIC, ids=[c.name for c in STATIC])
def test_static_nodes_see_torchruns_environment(runner: Runner, case: Case) -> None:
    same_env(runner(case), 2, run_id="none", given_port=True)


@pytest.mark.timeout(300)
def test_a_one_node_static_job_uses_the_given_master(runner: Runner) -> None:
    runs = runner(STATIC_ONE)
    same_env(runs, 2, run_id="none", given_port=True)
    t, f = runs["torchrun"].probes[0]["env"], runs["flexrun"].probes[0]["env"]
    assert t["TORCHELASTIC_USE_AGENT_STORE"] == "True" == f["TORCHELASTIC_USE_AGENT_STORE"]


STATIC_LOSS = Case(
    "static_node_loss",
    ("--nnodes=2", "--nproc_per_node=1", "--master_addr=127.0.0.1", "--master_port={port}",
     "--rdzv-conf", "heartbeat_timeout=3"),
    script_args=("--sleep", "120"),
    nodes=(("--node_rank=0",), ("--node_rank=1",)),
)  # fmt: skip


@pytest.mark.timeout(300)
def test_a_lost_static_node_ends_the_job_with_node_lost(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Beyond torchrun (whose survivors wait in a collective): flexrun only."""
    run, procs = start(STATIC_LOSS, "flexrun", tmp_path / "flexrun")
    try:
        wait_for_probes(run, 2, timeout=90)
        kill_tree(procs[1])
        procs[0].wait(timeout=30)  # heartbeat_timeout 3 s, and some slack
        finish(STATIC_LOSS, run, procs, time.monotonic() + 10)
        assert run.rc[0] == 200, run.stderr[-2000:]
        assert "node" in run.stderr and "lost" in run.stderr
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p)
                p.wait(timeout=30)
