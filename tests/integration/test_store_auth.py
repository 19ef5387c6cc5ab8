"""Issue 18's acceptance: a stranger plays against a running 2-node job (real agents, the
DDP test script) on the tcp store and on etcd. With the job's secret set, a client without
it can neither add a node, nor change a round (compare-and-set a FAILED round), nor fail
the job: the job trains on and finishes 0, and an event records each rejected record.
Without a secret, the agents warn."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from support import DDP_STEPS, Procs, node_args, read_events, read_progress, wait_for

from flexrun.rendezvous.state import FAILED, Claim, Keys, NodeRecord, RoundRecord
from flexrun.store.api import Store
from flexrun.store.tcp import TcpStore

HB = "heartbeat_interval=0.5,heartbeat_timeout=3,last_call_timeout=0.5,join_timeout=60"


def _stranger(backend: str, endpoint: str) -> Store:
    host, _, port = endpoint.partition(",")[0].rpartition(":")
    if backend == "c10d":
        return TcpStore(host, int(port), connect_timeout_s=10)
    from flexrun.store.etcd import EtcdStore

    return EtcdStore([(host, int(port))], connect_timeout_s=10)


def _agent(
    procs: Procs,
    backend: str,
    endpoint: str,
    name: str,
    progress: Path,
    env: dict[str, str],
    steps: int,
) -> Any:
    return procs.start(
        [
            *node_args(
                endpoint,
                name,
                procs.tmp / f"run-{name}",
                nproc=1,
                nnodes="1:3",
                backend=backend,
                conf=HB,
            ),
            "--max-restarts",
            "0",
            str(DDP_STEPS),
            "--steps",
            str(steps),
            "--step-time",
            "0.05",
            "--progress",
            str(progress),
        ],
        name=name,
        env=env,
    )


@pytest.mark.timeout(300)
def test_a_stranger_without_the_secret_can_neither_join_change_a_round_nor_fail_the_job(
    procs: Procs, endpoint: tuple[str, str]
) -> None:
    backend, ep = endpoint
    secret = procs.tmp / "secret"
    secret.write_text(os.urandom(32).hex())
    secret.chmod(0o600)
    env = {"FLEXRUN_JOB_SECRET_FILE": str(secret)}
    progress = procs.tmp / "progress.jsonl"
    a = _agent(procs, backend, ep, "a", progress, env, 400)
    b = _agent(procs, backend, ep, "b", progress, env, 400)
    wait_for(lambda: 2 in {r["world"] for r in read_progress(progress)}, 120, "a 2-node round")
    t_attack = time.time()

    keys = Keys("job")
    stranger = _stranger(backend, ep)
    stop = threading.Event()

    def impostor() -> None:  # a node that keeps "beating" without the secret
        record = NodeRecord("evil", "127.0.0.1", 4).encode()
        stranger.put(keys.node("evil"), record)
        while not stop.is_set():
            stranger.put(keys.heartbeat("evil"), record, ttl_s=3)
            stop.wait(0.3)

    t = threading.Thread(target=impostor, daemon=True)
    t.start()
    try:
        # Compare-and-set a FAILED round over the current one, as a malicious client would.
        current = stranger.get(keys.round)
        assert current is not None
        failed = RoundRecord(99, FAILED, (), 9, "restarts_exhausted", 42)
        ok, _ = stranger.compare_and_set(
            keys.round, failed.header(), expected_revision=current.revision
        )
        assert ok, "the stranger's write itself succeeds: the store does not authenticate clients"
        claim = stranger.get(keys.watcher)
        assert claim is not None
        stranger.compare_and_set(
            keys.watcher, Claim("evil", 99).encode(), expected_revision=claim.revision
        )
        stranger.put(keys.heartbeat("a"), b"junk over a member's keep-alive", ttl_s=3)
        time.sleep(6)  # two heartbeat timeouts: long enough for a lost node or a new round
    finally:
        stop.set()
        t.join(timeout=5)
        stranger.close()

    assert a.wait(timeout=180) == 0, procs.stderr("a")[-2000:]
    assert b.wait(timeout=60) == 0, procs.stderr("b")[-2000:]
    after = [r for r in read_progress(progress) if r["ts"] > t_attack]
    assert after and {r["world"] for r in after} == {2}, "the stranger changed the world size"
    assert len({r["attempt"] for r in after}) == 1, "the workers were restarted"
    assert max(r["step"] for r in read_progress(progress)) >= 399
    for name in ("a", "b"):
        events = read_events(procs.tmp / f"run-{name}")
        assert "store_unauthenticated" not in [e["event"] for e in events]
        late = [e["event"] for e in events if e["ts"] > t_attack]
        for kind in ("restart", "node_lost", "node_left", "scale_up", "rendezvous_completed"):
            assert kind not in late, (name, late)
    rejected = {
        e["key"]
        for name in ("a", "b")
        for e in read_events(procs.tmp / f"run-{name}")
        if e["event"] == "store_record_rejected"
    }
    assert keys.round in rejected and keys.watcher in rejected, rejected
    assert keys.heartbeat("evil") in rejected and keys.node("evil") in rejected, rejected


@pytest.mark.timeout(240)
def test_without_a_secret_the_agents_of_a_multi_node_job_warn(procs: Procs) -> None:
    from support import free_port

    port = free_port()
    procs.start(["store", "--host", "127.0.0.1", "--port", str(port)], name="store")
    wait_for(lambda: "listening" in (procs.tmp / "store.out").read_text(), 30, "the store")
    progress = procs.tmp / "progress.jsonl"
    env = {"FLEXRUN_JOB_SECRET_FILE": "", "FLEXRUN_JOB_SECRET": ""}
    a = _agent(procs, "c10d", f"127.0.0.1:{port}", "a", progress, env, 20)
    b = _agent(procs, "c10d", f"127.0.0.1:{port}", "b", progress, env, 20)
    assert a.wait(timeout=180) == 0 and b.wait(timeout=60) == 0
    for name in ("a", "b"):
        assert "store_unauthenticated" in [
            e["event"] for e in read_events(procs.tmp / f"run-{name}")
        ]
        assert "NOT AUTHENTICATED" in procs.stderr(name)
