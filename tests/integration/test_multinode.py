"""Several agents as several nodes on one machine, sharing a standalone `flexrun store`."""

from __future__ import annotations

import os
import signal
import time

import pytest
from support import (
    DDP_STEPS,
    Procs,
    alive_pids,
    descendants,
    endless,
    free_port,
    node_args,
    read_events,
    read_progress,
    scrape_metrics,
    wait_for,
    worlds_after,
)


def _agent(procs: Procs, store: tuple[str, int], name: str, progress, *extra: str):  # type: ignore[no-untyped-def]
    host, port = store
    return procs.start(
        [
            *node_args(f"{host}:{port}", name, procs.tmp / f"run-{name}", nproc=2),
            "--max-restarts",
            "0",
            *extra,
            *endless(DDP_STEPS, progress),
        ],
        name=name,
    )


@pytest.mark.timeout(240)
def test_kill_9_of_one_agent_leaves_the_survivor_alone_then_a_new_agent_grows_it_back(
    procs: Procs, store_server: tuple[str, int]
) -> None:
    progress = procs.tmp / "progress.jsonl"
    a = _agent(procs, store_server, "a", progress)
    metrics_port = free_port()
    b = _agent(procs, store_server, "b", progress, "--metrics-port", str(metrics_port))
    wait_for(
        lambda: 4 in {r["world"] for r in read_progress(progress)}, 90, "a 2-node round (world 4)"
    )
    wait_for(
        lambda: scrape_metrics(metrics_port).get("flexrun_world_size") == 4.0,
        30,
        "metrics: world size 4",
    )

    tree_a = [p.pid for p in descendants(a.pid)]
    os.killpg(a.pid, signal.SIGKILL)  # the agent and its workers: a lost node
    a.wait(timeout=10)
    t_kill = time.time()
    wait_for(
        lambda: 2 in worlds_after(progress, t_kill + 0.5), 60, "survivor training alone at world 2"
    )
    assert b.poll() is None
    wait_for(
        lambda: scrape_metrics(metrics_port).get("flexrun_world_size") == 2.0,
        30,
        "metrics to show world size 2",
    )
    wait_for(lambda: alive_pids(tree_a) == [], 10, "the lost node's workers to be gone")

    t_join = time.time()
    c = _agent(procs, store_server, "c", progress)
    wait_for(lambda: 4 in worlds_after(progress, t_join), 90, "the job to grow back to 2 nodes")
    assert b.poll() is None and c.poll() is None
    events = read_events(procs.tmp / "run-b")
    kinds = [e["event"] for e in events]
    assert "node_lost" in kinds or any(
        e["event"] == "scale_down" for e in read_events(procs.tmp / "run-c")
    )
    assert "scale_up" in kinds or "scale_up" in [
        e["event"] for e in read_events(procs.tmp / "run-c")
    ]


@pytest.mark.timeout(240)
def test_a_stopped_node_is_removed_within_the_heartbeat_timeout(
    procs: Procs, store_server: tuple[str, int]
) -> None:
    progress = procs.tmp / "progress.jsonl"
    a = _agent(procs, store_server, "a", progress)
    b = _agent(procs, store_server, "b", progress)
    wait_for(
        lambda: 4 in {r["world"] for r in read_progress(progress)}, 90, "a 2-node round (world 4)"
    )
    os.killpg(a.pid, signal.SIGSTOP)  # agent and workers frozen: alive but silent
    t_stop = time.time()
    wait_for(
        lambda: 2 in worlds_after(progress, t_stop + 0.5),
        60,
        "survivors re-formed without the stopped node",
    )
    rounds = [e for e in read_events(procs.tmp / "run-b") if e["event"] == "rendezvous_completed"]
    last = rounds[-1]
    assert last["members"] == ["b"] and last["world_size"] == 2
    # Detection took about the heartbeat timeout (3 s) plus a restart, not a collective timeout.
    lost = [e for e in read_events(procs.tmp / "run-b") if e["event"] == "node_lost"]
    assert lost and lost[-1]["node_id"] == "a"
    assert lost[-1]["ts"] - t_stop < 15
    assert b.poll() is None
    os.killpg(a.pid, signal.SIGCONT)


@pytest.mark.timeout(240)
def test_a_job_keeps_training_while_its_store_is_down_and_rejoins_a_restarted_store(
    procs: Procs,
) -> None:
    import time

    port = free_port()
    store = procs.start(["store", "--host", "127.0.0.1", "--port", str(port)], name="store1")
    wait_for(lambda: "listening" in (procs.tmp / "store1.out").read_text(), 30, "store")
    progress = procs.tmp / "progress.jsonl"
    a = _agent(procs, ("127.0.0.1", port), "a", progress)
    wait_for(lambda: read_progress(progress), 90, "training to start")

    store.kill()
    store.wait(timeout=10)
    t_down = time.time()
    time.sleep(4)  # longer than the heartbeat timeout: nothing may react to the outage but logs
    during = [r for r in read_progress(progress) if r["ts"] > t_down + 0.5]
    assert during and {r["attempt"] for r in during} == {"1"}, (
        "training stopped while the store was down"
    )
    assert a.poll() is None

    store2 = procs.start(["store", "--host", "127.0.0.1", "--port", str(port)], name="store2")
    wait_for(lambda: "listening" in (procs.tmp / "store2.out").read_text(), 30, "restarted store")
    wait_for(
        lambda: "store_recovered" in [e["event"] for e in read_events(procs.tmp / "run-a")],
        30,
        "the agent to reconnect",
    )
    kinds = [e["event"] for e in read_events(procs.tmp / "run-a")]
    assert "store_unavailable" in kinds and ("store_rejoined" in kinds or "round_restored" in kinds)
    assert {r["attempt"] for r in read_progress(progress)} == {"1"}, (
        "the outage restarted the workers"
    )

    # The restored store is live: a second node can join and the job grows to world size 4.
    t_join = time.time()
    _agent(procs, ("127.0.0.1", port), "b", progress)
    wait_for(
        lambda: 4 in worlds_after(progress, t_join),
        90,
        "the job to grow after the store came back",
    )
    assert a.poll() is None
    store2.terminate()
