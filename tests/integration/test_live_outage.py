"""Store outages and authentication with real processes: live workers train on through a
store restart, an agent started while the store is down joins once it is back, and a live
job with a secret ignores a forged epoch record."""

from __future__ import annotations

import time

import pytest
from live_support import LIVE_STEPS, live_workers, start_live_node
from support import (
    DDP_STEPS,
    HB,
    Procs,
    endless,
    free_port,
    node_args,
    read_events,
    read_progress,
    wait_for,
)

from flexrun.live_protocol import EpochRecord, LiveKeys
from flexrun.store.tcp import TcpStore

HB_NO_HOST = HB + ",is_host=false"


def start_store(procs: Procs, port: int, name: str):  # type: ignore[no-untyped-def]
    store = procs.start(["store", "--host", "127.0.0.1", "--port", str(port)], name=name)
    wait_for(
        lambda: "listening" in (procs.tmp / f"{name}.out").read_text(), 30, f"{name} to listen"
    )
    return store


def steps_after(progress, ts: float) -> list[dict]:  # type: ignore[no-untyped-def]
    return [r for r in read_progress(progress) if "step" in r and r["ts"] > ts]


@pytest.mark.timeout(300)
def test_a_live_job_keeps_its_worker_pids_and_trains_on_through_a_10s_store_restart(
    procs: Procs,
) -> None:
    port = free_port()
    store = start_store(procs, port, "store1")
    progress = procs.tmp / "p.jsonl"
    a = start_live_node(procs, f"127.0.0.1:{port}", "a", progress, "--warm-spares", "0", nproc=2)
    pids = live_workers(procs.tmp / "run-a", 2)
    wait_for(lambda: steps_after(progress, 0), 90, "node a to train")

    store.kill()
    store.wait(timeout=10)
    t_down = time.time()
    time.sleep(10)
    during = steps_after(progress, t_down + 1)
    assert during, "training stopped while the store was down"
    assert {r["pid"] for r in during} == set(pids) and {r["world"] for r in during} == {2}
    assert a.poll() is None, procs.stderr("a")[-3000:]

    start_store(procs, port, "store2")
    t_up = time.time()
    wait_for(
        lambda: "live_epoch_restored" in [e["event"] for e in read_events(procs.tmp / "run-a")],
        60,
        "the agent to publish the epoch again",
    )
    wait_for(lambda: len(steps_after(progress, t_up + 1)) > 10, 60, "training after the restart")
    after = steps_after(progress, t_up + 1)
    assert {r["pid"] for r in after} == set(pids), "a worker was restarted"
    exited = [e for e in read_events(procs.tmp / "run-a") if e["event"] == "worker_exited"]
    assert not exited, exited
    # The membership protocol works on the restarted store: a second node joins.
    t_join = time.time()
    start_live_node(procs, f"127.0.0.1:{port}", "b", progress, "--warm-spares", "0", nproc=2)

    def four() -> list[dict]:
        rows = [r for r in steps_after(progress, t_join) if r["world"] == 4]
        return rows if len({r["rank"] for r in rows}) == 4 else []

    # (every member of the world of 4 stepped, not the first to write: one rank's row
    # can come before the others')
    rows = wait_for(four, 120, "all four ranks to train after node b joined")
    assert set(pids) <= {r["pid"] for r in rows}  # type: ignore[attr-defined]
    assert a.poll() is None


@pytest.mark.timeout(240)
def test_an_agent_started_while_the_store_is_down_joins_once_it_is_back(procs: Procs) -> None:
    port = free_port()
    progress = procs.tmp / "p.jsonl"
    agent = procs.start(
        [
            # (is_host=false: the endpoint is this host, but the store is a `flexrun store`)
            *node_args(
                f"127.0.0.1:{port}", "a", procs.tmp / "run-a", nproc=2, nnodes="1", conf=HB_NO_HOST
            ),
            *endless(DDP_STEPS, progress),
        ],
        name="a",
    )
    time.sleep(6)
    assert agent.poll() is None, procs.stderr("a")[-2000:]
    start_store(procs, port, "store")
    wait_for(lambda: read_progress(progress), 120, "the agent to join and train")
    assert agent.poll() is None
    kinds = [e["event"] for e in read_events(procs.tmp / "run-a")]
    assert "node_joined" in kinds


@pytest.mark.timeout(240)
def test_a_live_job_with_a_secret_trains_and_ignores_a_forged_epoch_record(
    procs: Procs, store_server: tuple[str, int]
) -> None:
    host, port = store_server
    secret = procs.tmp / "secret"
    secret.write_text("s" * 32)
    secret.chmod(0o600)
    progress = procs.tmp / "p.jsonl"
    a = procs.start(
        [
            "run",
            "--nnodes",
            "1",
            "--nproc-per-node",
            "2",
            "--mode",
            "live",
            "--warm-spares",
            "0",
            "--rdzv-endpoint",
            f"{host}:{port}",
            "--rdzv-id",
            "livejob",
            "--rdzv-conf",
            f"heartbeat_interval=0.5,heartbeat_timeout=3,join_timeout=60,secret_file={secret}",
            "--node-id",
            "a",
            "--run-dir",
            str(procs.tmp / "run-a"),
            *endless(LIVE_STEPS, progress),
        ],
        name="a",
    )
    pids = live_workers(procs.tmp / "run-a", 2)
    wait_for(lambda: len(steps_after(progress, 0)) > 5, 90, "the signed live job to train")
    epoch = max(r["epoch"] for r in steps_after(progress, 0))

    stranger = TcpStore(host, port)  # no secret: what it writes does not verify
    forged = EpochRecord(epoch + 50, ("intruder.w1",), True)
    stranger.put(LiveKeys("livejob").epoch, forged.encode())
    t_forged = time.time()
    wait_for(
        lambda: len(steps_after(progress, t_forged + 1)) > 10, 60, "training after the forgery"
    )
    after = steps_after(progress, t_forged + 1)
    assert {r["pid"] for r in after} == set(pids)
    assert {r["epoch"] for r in after} == {epoch} and {r["world"] for r in after} == {2}
    rejected = [
        e
        for e in read_events(procs.tmp / "run-a")
        if e["event"] == "store_record_rejected" and e["key"].endswith("live/epoch")
    ]
    assert any(str(e.get("node", "")).startswith("a.w") for e in rejected), rejected
    assert a.poll() is None
    stranger.close()
