"""The single etcd server dies for 10 s mid-training and comes back on the same data dir."""

from __future__ import annotations

import os
import signal
import time

import pytest
from support import Procs, read_events, read_progress, wait_for, worlds_after
from test_etcd_rendezvous import _agent, etcd1  # noqa: F401  (fixture)

from flexrun.testing.etcd_server import EtcdCluster


@pytest.mark.timeout(300)
def test_training_survives_a_10s_etcd_outage_and_a_node_lost_meanwhile_is_handled_after(
    procs: Procs,
    etcd1: EtcdCluster,  # noqa: F811
) -> None:
    progress = procs.tmp / "progress.jsonl"
    a = _agent(procs, etcd1, "a", progress)
    b = _agent(procs, etcd1, "b", progress)
    wait_for(lambda: 2 in {r["world"] for r in read_progress(progress)}, 120, "a 2-node round")

    etcd1.kill(0)
    t_down = time.time()
    time.sleep(3)
    os.killpg(b.pid, signal.SIGKILL)  # a node lost while the store is gone
    b.wait(timeout=10)
    time.sleep(7)
    during = [r for r in read_progress(progress) if t_down + 0.5 < r["ts"]]
    assert during, "training stopped while etcd was down"
    assert a.poll() is None

    etcd1.start_member(0)
    etcd1.wait_ready()
    t_up = time.time()
    wait_for(
        lambda: 1 in worlds_after(progress, t_up),
        90,
        "the survivor to re-form alone once etcd is back",
    )
    kinds = [e["event"] for e in read_events(procs.tmp / "run-a")]
    assert "store_unavailable" in kinds and "store_recovered" in kinds
    assert "node_lost" in kinds
    assert a.poll() is None
