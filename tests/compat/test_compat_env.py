"""What the script sees: the launcher's variables, argv, ``__file__``, on both launchers.

Ports torch's launcher tests (``test/distributed/launcher/run_test.py``: standalone, nnodes
ranges, module mode, ``--no-python``, ``--run-path``, the PET_* launch, nproc auto/cpu) and
issue 21's command lines that a one-host job can show.
"""

from __future__ import annotations

import sys

import pytest
from compat_checks import same_env, same_script_view, succeeded
from compat_support import NO_SHUTDOWN_TIMEOUT, OLD_DEFAULT_BACKEND, SCRIPTS, Case, Runner

ENDPOINT = ("--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:{port}")
SHORT_LAST_CALL = ("--rdzv-conf", "last_call_timeout=1")  # torchrun waits 30 s otherwise

CASES = [
    # (case, workers, run id when fixed)
    (Case("standalone", ("--standalone", "--nproc-per-node", "2"), script_args=("a", "--b", "c")), 2, None),
    (Case("defaults", ()), 1, None),
    (Case("default_nproc_static_one_node", ("--nnodes", "1")), 1, None),
    (Case("nnodes_range_one_agent", ("--nnodes", "1:2", "--nproc-per-node", "2", *ENDPOINT,
          "--rdzv-id", "range", *SHORT_LAST_CALL)), 2, "range"),
    (Case("endpoint_port_zero", ("--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0",
          "--nproc-per-node", "2")), 2, None),
    (Case("module_mode", ("--standalone", "--nproc-per-node", "2", "-m"), script="probepkg.main",
          script_args=("x",)), 2, None),
    (Case("run_path", ("--run-path", "--nproc-per-node", "2"), script_args=("--sleep", "0")), 2, None),
    (Case("role_and_ids", ("--nproc_per_node=2", "--role=trainer", *ENDPOINT, "--rdzv_id=ids",
          "--nnodes=1")), 2, "ids"),
    (Case("restarts_monitor_start_method", ("--standalone", "--max-restarts", "2",
          "--monitor-interval", "0.5", "--start-method", "fork")), 1, None),
    (Case("pet_standalone_is_bool_of_int", (), env={"PET_STANDALONE": "2",
          "PET_NPROC_PER_NODE": "2"}), 2, None),
    (Case("nproc_cpu", ("--standalone", "--nproc-per-node", "cpu")), None, None),
    (Case("nproc_auto", ("--standalone", "--nproc-per-node", "auto")), None, None),
    (Case("torchrun_rdzv_conf_keys", ("--nnodes", "1:2", *ENDPOINT, "--rdzv-id", "keys",
          "--rdzv-conf", "join_timeout=60,last_call_timeout=1,close_timeout=5,read_timeout=30,"
          "keep_alive_interval=2,keep_alive_max_attempt=3")), 1, "keys"),
    (Case("unknown_rdzv_conf_key", ("--standalone", "--rdzv-conf", "frobnicate=1")), 1, None),
    (Case("signals_and_shutdown_timeout", ("--standalone", "--nproc-per-node", "2",
          "--shutdown-timeout", "5", "--signals-to-handle", "SIGTERM,SIGINT,SIGUSR1,SIGNOPE")),
          2, None),
    (Case("user_omp_and_devices", ("--standalone", "--nproc-per-node", "2"),
          env={"OMP_NUM_THREADS": "3", "CUDA_VISIBLE_DEVICES": "0,1"}), 2, None),
    (Case("explicit_local_addr", ("--standalone", "--local-addr", "127.0.0.1")), 1, None),
    (Case("event_log_handler_null_and_rdzv", ("--standalone", "--event-log-handler",
          "dynamic_rendezvous")), 1, None),
    (Case("trainer_v2_pet_with_elastic_flags", ("--nnodes", "1:2", *ENDPOINT, "--rdzv-id", "tv2",
          *SHORT_LAST_CALL), env={"PET_NNODES": "4", "PET_NPROC_PER_NODE": "2",
          "PET_NODE_RANK": "3", "PET_MASTER_ADDR": "10.255.0.1", "PET_MASTER_PORT": "23456"}),
     2, "tv2"),
]  # fmt: skip


# Cases whose reference is torchrun 2.13's own behaviour (an older torchrun differs).
SINCE_2_13 = {
    "defaults": OLD_DEFAULT_BACKEND,
    "default_nproc_static_one_node": OLD_DEFAULT_BACKEND,
    "run_path": OLD_DEFAULT_BACKEND,
    "signals_and_shutdown_timeout": NO_SHUTDOWN_TIMEOUT,
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("case", "workers", "run_id"),
    [
        pytest.param(
            *c, id=c[0].name, marks=[SINCE_2_13[c[0].name]] if c[0].name in SINCE_2_13 else []
        )
        for c in CASES
    ],
)
def test_workers_see_the_same_environment(
    runner: Runner, case: Case, workers: int | None, run_id: str | None
) -> None:
    runs = runner(case)
    succeeded(runs)
    count = workers if workers is not None else len(runs["torchrun"].probes)
    assert count >= 1
    same_env(runs, count, run_id=run_id)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("case", "workers"),
    [(c, w) for c, w, _ in CASES if c.name in ("standalone", "module_mode", "run_path")],
    ids=["standalone", "module_mode", "run_path"],
)
def test_the_script_sees_the_same_argv_file_and_name(
    runner: Runner, case: Case, workers: int
) -> None:
    same_script_view(runner(case), workers)


@pytest.mark.timeout(300)
def test_an_unknown_rdzv_conf_key_is_named_once(runner: Runner) -> None:
    runs = runner(next(c for c, _, _ in CASES if c.name == "unknown_rdzv_conf_key"))
    assert runs["flexrun"].stderr.count("--rdzv-conf frobnicate: unknown key") == 1
    assert "frobnicate" not in runs["torchrun"].stderr  # torchrun: silently ignored


NO_PYTHON = [
    Case("no_python", ("--standalone", "--nproc-per-node", "2", "--no-python"),
         script=str(SCRIPTS / "probe.sh"), script_args=("arg1",)),
    # torch's test_launch_with_env_vars: everything from PET_*
    Case("pet_only_launch", (), script=str(SCRIPTS / "probe.sh"), script_args=("arg1",),
         env={"PET_NNODES": "1", "PET_NPROC_PER_NODE": "2", "PET_MONITOR_INTERVAL": "1",
              "PET_START_METHOD": "spawn", "PET_NO_PYTHON": "1"}),
]  # fmt: skip


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", NO_PYTHON, ids=[c.name for c in NO_PYTHON])
def test_executables_see_the_same_ranks_and_argv(runner: Runner, case: Case) -> None:
    runs = runner(case)
    succeeded(runs)
    t, f = runs["torchrun"].probes, runs["flexrun"].probes
    assert sorted(t) == sorted(f) == [0, 1]
    assert [f[r]["env"] for r in f] == [t[r]["env"] for r in t]
    assert [f[r]["argv"][1] for r in f] == [t[r]["argv"][1] for r in t] == ["arg1", "arg1"]


PYTHON_EXEC = Case(
    "python_exec",
    ("--standalone",),
    env={"PYTHON_EXEC": str(SCRIPTS / "python_exec.sh"), "COMPAT_REAL_PYTHON": sys.executable},
)


@pytest.mark.timeout(300)
def test_python_exec_chooses_the_workers_interpreter(runner: Runner) -> None:
    runs = runner(PYTHON_EXEC)
    succeeded(runs)
    same_env(runs, 1)
    assert runs["torchrun"].probes[0]["env"]["COMPAT_PYTHON_EXEC"] == "used"


VIRTUAL = Case(
    "virtual_local_rank",
    ("--standalone", "--nproc-per-node", "2", "--virtual-local-rank"),
    env={"CUDA_VISIBLE_DEVICES": "5,7"},
)


@pytest.mark.timeout(300)
def test_virtual_local_rank(runner: Runner) -> None:
    runs = runner(VIRTUAL)
    succeeded(runs)
    same_env(runs, 2)
    assert [p["env"]["CUDA_VISIBLE_DEVICES"] for p in runs["torchrun"].probes.values()] == [
        "5",
        "7",
    ]
