"""The fault injector's own rules, against real processes standing in for agents.

Found re-running the long chaos run (bench/results/chaos.txt, 2026-11-29 "pauses"): a
preempted agent is alive for its stop grace after SIGTERM, and the "keep at least one
node" rule counted it, so a kill_agent right after a term_agent left no node at all.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from flexrun.testing.chaos_job import RDZV_CONF, ChaosJob, JobSpec
from flexrun.testing.chaos_schedule import Fault

# Exits on SIGTERM only after a while, as an agent does while its workers save and stop.
SLOW_EXIT = (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *a: (time.sleep(20), sys.exit(143)))\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
)


def _agent() -> subprocess.Popen[bytes]:
    p = subprocess.Popen(
        [sys.executable, "-c", SLOW_EXIT], stdout=subprocess.PIPE, start_new_session=True
    )
    assert p.stdout is not None and p.stdout.readline() == b"ready\n"
    return p


@pytest.mark.timeout(30)
def test_an_agent_told_to_leave_does_not_count_as_the_node_that_must_remain(
    tmp_path: Path,
) -> None:
    job = ChaosJob(JobSpec(root=tmp_path))
    procs = {"n0": _agent(), "n1": _agent()}
    try:
        job.agents.update(procs)
        term = job.inject(Fault(1.0, "term_agent", pick=0, hold_s=1.0))
        assert term["outcome"] == "done" and term["node"] == "n0"
        assert procs["n0"].poll() is None  # still saving and stopping: alive, but leaving
        kill = job.inject(Fault(2.0, "kill_agent", pick=1, hold_s=1.0))
        assert kill == {"outcome": "skipped", "reason": "only one node left"}, kill
        assert procs["n1"].poll() is None
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.wait(timeout=10)
            assert p.stdout is not None
            p.stdout.close()


def test_agents_never_host_the_store_that_the_injector_restarts() -> None:
    # An agent started during a restart_store outage would otherwise host the store on the
    # endpoint's port itself (c10d semantics) and the restarted store fails EADDRINUSE.
    conf = dict(kv.split("=", 1) for kv in RDZV_CONF.split(","))
    assert conf.get("is_host") in ("0", "false")


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "spec",
    [
        {"launcher": "restart"},
        {"launcher": "live"},
        {"launcher": "live", "nproc": 2, "shards": 2},
    ],
    ids=["restart", "live", "live_hsdp"],
)
def test_the_agents_command_line_hands_every_workload_argument_to_the_script(
    tmp_path: Path, spec: dict
) -> None:
    # The workload's --live abbreviates flexrun run's --live-shards and --live_shards, and
    # flexrun run (like torchrun's parser) refuses a script argument that abbreviates two
    # of its options: every live chaos job exited 2 at once after --live-shards came.
    from flexrun.cli import build_parser

    job = ChaosJob(JobSpec(root=tmp_path, **spec))
    argv = job.agent_argv("n0")
    ns = build_parser({}).parse_args(argv[argv.index("run") :])
    script_at = argv.index(ns.training_script)
    assert ns.training_script_args == argv[script_at + 1 :]
    assert int(ns.live_shards or 1) == spec.get("shards", 1)


def test_a_sharded_job_is_a_live_one_with_whole_groups_per_agent(tmp_path: Path) -> None:
    from flexrun.errors import ConfigError

    with pytest.raises(ConfigError):
        JobSpec(root=tmp_path, launcher="restart", nproc=2, shards=2)
    with pytest.raises(ConfigError):
        JobSpec(root=tmp_path, launcher="live", nproc=3, shards=2)
