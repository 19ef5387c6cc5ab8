"""Several agents as several nodes on one machine, meeting in a real etcd (issue #4)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import (
    DDP_STEPS,
    Procs,
    alive_pids,
    descendants,
    endless,
    node_args,
    read_events,
    read_progress,
    wait_for,
    worlds_after,
)

from flexrun.testing.etcd_server import MISSING, EtcdCluster, etcd_binary


def _require_etcd() -> None:
    if etcd_binary() is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{MISSING}; CI must run the etcd integration tests")
        pytest.skip(MISSING)


def _etcd(tmp: Path, size: int) -> Iterator[EtcdCluster]:
    _require_etcd()
    with EtcdCluster(tmp / "etcd", size=size) as cluster:
        yield cluster


@pytest.fixture
def etcd1(procs: Procs) -> Iterator[EtcdCluster]:
    yield from _etcd(procs.tmp, 1)


@pytest.fixture
def etcd3(procs: Procs) -> Iterator[EtcdCluster]:
    yield from _etcd(procs.tmp, 3)


def _agent(procs: Procs, cluster: EtcdCluster, name: str, progress: Path, first: int = 0):  # type: ignore[no-untyped-def]
    # Agents talk to the first endpoint that answers; ``first`` chooses which member that is.
    eps = cluster.endpoints[first:] + cluster.endpoints[:first]
    endpoint = ",".join(f"{h}:{p}" for h, p in eps)
    return procs.start(
        [
            *node_args(endpoint, name, procs.tmp / f"run-{name}", nproc=1, backend="etcd-v3"),
            "--max-restarts",
            "0",
            *endless(DDP_STEPS, progress),
        ],
        name=name,
    )


@pytest.mark.timeout(240)
def test_kill_9_of_one_agent_on_etcd_leaves_the_survivor_alone_then_a_new_agent_grows_it_back(
    procs: Procs, etcd1: EtcdCluster
) -> None:
    progress = procs.tmp / "progress.jsonl"
    a = _agent(procs, etcd1, "a", progress)
    b = _agent(procs, etcd1, "b", progress)
    wait_for(
        lambda: 2 in {r["world"] for r in read_progress(progress)}, 90, "a 2-node round (world 2)"
    )

    tree_a = [p.pid for p in descendants(a.pid)]
    os.killpg(a.pid, signal.SIGKILL)  # the agent and its workers: a lost node
    a.wait(timeout=10)
    t_kill = time.time()
    # The lease TTL (heartbeat_timeout=3) plus a restart; the bound is generous, not a speed claim.
    wait_for(
        lambda: 1 in worlds_after(progress, t_kill + 0.5), 60, "survivor training alone at world 1"
    )
    assert b.poll() is None
    wait_for(lambda: alive_pids(tree_a) == [], 10, "the lost node's workers to be gone")
    lost = [e for e in read_events(procs.tmp / "run-b") if e["event"] == "node_lost"]
    assert lost and lost[-1]["node_id"] == "a"

    t_join = time.time()
    c = _agent(procs, etcd1, "c", progress)
    wait_for(lambda: 2 in worlds_after(progress, t_join), 90, "the job to grow back to 2 nodes")
    assert b.poll() is None and c.poll() is None
    kinds = [e["event"] for e in read_events(procs.tmp / "run-b")]
    kinds_c = [e["event"] for e in read_events(procs.tmp / "run-c")]
    assert "scale_up" in kinds or "scale_up" in kinds_c
    rounds = [e for e in read_events(procs.tmp / "run-b") if e["event"] == "rendezvous_completed"]
    assert sorted(rounds[-1]["members"]) == ["b", "c"]


@pytest.mark.timeout(240)
def test_killing_the_etcd_leader_of_a_3_member_cluster_changes_no_round_and_restarts_nothing(
    procs: Procs, etcd3: EtcdCluster
) -> None:
    progress = procs.tmp / "progress.jsonl"
    # Both agents start on the leader, so its death also breaks their connections and watches.
    leader = etcd3.leader()
    a = _agent(procs, etcd3, "a", progress, first=leader)
    b = _agent(procs, etcd3, "b", progress, first=leader)
    wait_for(
        lambda: 2 in {r["world"] for r in read_progress(progress)}, 90, "a 2-node round (world 2)"
    )
    time.sleep(1.0)  # let the round settle: both agents have seen "running"

    def started(node: str) -> int:
        return sum(e["event"] == "worker_started" for e in read_events(procs.tmp / f"run-{node}"))

    def completed(node: str) -> int:
        return sum(
            e["event"] == "rendezvous_completed" for e in read_events(procs.tmp / f"run-{node}")
        )

    before = {n: (started(n), completed(n)) for n in ("a", "b")}
    leader = etcd3.leader()  # (leadership rarely moves, but kill whoever leads now)
    etcd3.kill(leader)
    t_kill = time.time()
    # Twice the heartbeat timeout: long enough for a lost lease or a broken watch to show.
    wait_for(
        lambda: any(r["ts"] > t_kill + 7 for r in read_progress(progress)),
        60,
        "training to continue 7 s past the leader's death",
    )
    after = [r for r in read_progress(progress) if r["ts"] > t_kill]
    assert {r["world"] for r in after} == {2}
    assert a.poll() is None and b.poll() is None
    assert {n: (started(n), completed(n)) for n in ("a", "b")} == before
    # The survivors elected a new leader and still serve.
    etcd3.wait_ready(30, members=[i for i in range(3) if i != leader])
