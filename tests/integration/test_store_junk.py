"""Issue 33's acceptance: a stranger without the job secret writes junk bytes over every key
of a running signed 2-node job (real agents, the DDP test script), on the tcp store (a bare
``torch.distributed.TCPStore`` client, which also overwrites the store's own revision
counter, change log and ring counts) and on etcd (its v3 JSON gateway, which also adds keys
that are not UTF-8 under the job's prefix). The agents stay up, print no traceback, and the
job finishes 0; the junk is reported as ``store_record_rejected``."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
from junk_support import EtcdJunk, TcpJunk
from support import DDP_STEPS, Procs, node_args, read_events, read_progress, wait_for

from flexrun.rendezvous.state import Keys

HB = "heartbeat_interval=0.5,heartbeat_timeout=6,last_call_timeout=0.5,join_timeout=60"
JUNK = (b"garbage", b"\xff\xfe\x00", b"abc", b"", b"12 -\n\xff", b"FXS1 x", b"7 x\nleft over")
ATTACK_S = 8.0


def _agent(procs: Procs, backend: str, endpoint: str, name: str, env: dict[str, str]) -> Any:
    return procs.start(
        [
            *node_args(
                endpoint,
                name,
                procs.tmp / f"run-{name}",
                nproc=1,
                nnodes="2",
                backend=backend,
                conf=HB,
            ),
            "--max-restarts",
            "3",
            str(DDP_STEPS),
            "--steps",
            "300",
            "--step-time",
            "0.05",
            "--progress",
            str(procs.tmp / "progress.jsonl"),
        ],
        name=name,
        env=env,
    )


def _attack_tcp(endpoint: str, root: str, until: float) -> int:
    """Junk over every key of the job and the store's own bookkeeping, until ``until``."""
    host, _, port = endpoint.rpartition(":")
    raw = TcpJunk(host, int(port))
    writes = 0
    while not writes or time.monotonic() < until:
        keys = raw.keys()
        events = sorted(
            (k for k in keys if k.startswith("__flexrun/ev/")), key=lambda k: int(k[13:])
        )
        targets = [k for k in keys if k.startswith(root)] + events[-8:]
        targets += ["__flexrun/rev", "__flexrun/watched", "__flexrun/epoch"]
        targets += [k for k in keys if k.startswith("__flexrun/chn/")]
        for i, key in enumerate(targets):
            raw.put(key, JUNK[(writes + i) % len(JUNK)])
        raw.put(f"{root}s/nodes/junk", b"\xff\xfe")
        raw.put(root.encode() + b"s/nodes/\xff\xfe-not-utf8", b"\xff")  # (TCPStore.list_keys fails)
        writes += len(targets) + 2
        time.sleep(0.5)
    return writes


def _attack_etcd(endpoint: str, root: str, until: float) -> int:
    host, _, port = endpoint.partition(",")[0].rpartition(":")
    raw = EtcdJunk(host, int(port))
    writes = 0
    while not writes or time.monotonic() < until:
        targets = raw.keys(root.encode())
        for i, key in enumerate(targets):
            raw.put(key, JUNK[(writes + i) % len(JUNK)])
        for sub in (b"", b"s/nodes/", b"hb/", b"s/"):
            raw.put(root.encode() + sub + b"\xff\xfe-not-utf8", b"\xff")
        writes += len(targets) + 4
        time.sleep(0.5)
    return writes


@pytest.mark.timeout(420)
def test_junk_over_every_key_of_a_signed_two_node_job_neither_stops_nor_fails_it(
    procs: Procs, endpoint: tuple[str, str]
) -> None:
    backend, ep = endpoint
    secret = procs.tmp / "secret"
    secret.write_text(os.urandom(32).hex())
    secret.chmod(0o600)
    env = {"FLEXRUN_JOB_SECRET_FILE": str(secret)}
    progress = procs.tmp / "progress.jsonl"
    a = _agent(procs, backend, ep, "a", env)
    b = _agent(procs, backend, ep, "b", env)
    wait_for(lambda: 2 in {r["world"] for r in read_progress(progress)}, 180, "a 2-node round")
    root = Keys("job").root
    attack = _attack_tcp if backend == "c10d" else _attack_etcd
    t_attack = time.time()
    written = attack(ep, root, time.monotonic() + ATTACK_S)
    assert written > 20, written
    assert a.poll() is None and b.poll() is None, (
        "an agent exited under the junk: " + procs.stderr("a")[-1500:] + procs.stderr("b")[-1500:]
    )

    assert a.wait(timeout=240) == 0, procs.stderr("a")[-3000:]
    assert b.wait(timeout=120) == 0, procs.stderr("b")[-3000:]
    for name in ("a", "b"):
        # The agent's own lines (a worker's are prefixed "[rankN]:"; junk written over a
        # keep-alive as fast as it beats is a denial of service that may re-form the world,
        # whose stopped workers print theirs: SECURITY.md, Limits).
        agent_lines = [ln for ln in procs.stderr(name).splitlines() if not ln.startswith("[rank")]
        assert not [ln for ln in agent_lines if "Traceback" in ln], procs.stderr(name)[-3000:]
    assert max(r["step"] for r in read_progress(progress)) >= 299
    assert any(r["ts"] > t_attack for r in read_progress(progress)), "no step after the attack"
    rejected = [
        e
        for name in ("a", "b")
        for e in read_events(procs.tmp / f"run-{name}")
        if e["event"] == "store_record_rejected" and e["ts"] >= t_attack
    ]
    assert rejected, "the junk was not reported"
    assert len(rejected) < 2000, "reports of junk are not rate-limited"
