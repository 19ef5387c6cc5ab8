"""Operator-environment simulation: the rendered Worker pods, started as Kubeflow would.

Each "pod" is an agent started with exactly the environment Kubeflow's v1 operator injects
for the rendered elastic PyTorchJob (kubeflow/trainer ``release-1.9``,
``pkg/controller.v1/pytorch/envvar.go`` and ``elastic.go``: ``PYTHONUNBUFFERED``,
``PET_NPROC_PER_NODE``, ``PET_NNODES``, ``PET_RDZV_BACKEND``, ``PET_RDZV_ENDPOINT``, and,
when set, ``PET_MAX_RESTARTS``, ``PET_RDZV_ID``, ``PET_RDZV_CONF``), plus the container's
own env with ``$(VAR)`` expanded as the kubelet does, running the rendered command. The
store Service's DNS name resolves to the local ``flexrun store``, as cluster DNS would.
Then: they form one job; SIGTERM to one pod's agent (a spot reclaim) -> its workers get
SIGTERM, it exits 143 (which ``restartPolicy: ExitCode`` retries) and the others go on; a
new pod joins -> the job scales back up.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from k8s_pods import Mounts, container_env, expand
from support import wait_for

from flexrun.k8s.render import render
from flexrun.k8s.spec import parse_job_spec

DDP_STEPS = Path(__file__).resolve().parents[1] / "scripts" / "ddp_steps.py"
DEFAULT_PYTORCHJOB_PORT = 23456


def operator_env(job: dict[str, Any]) -> dict[str, str]:
    """What the v1 operator injects into a Worker of an elastic, Workers-only PyTorchJob."""
    spec, name = job["spec"], job["metadata"]["name"]
    elastic = spec["elasticPolicy"]
    env = {"PYTHONUNBUFFERED": "1"}
    if spec.get("nprocPerNode") is not None:
        env["PET_NPROC_PER_NODE"] = str(spec["nprocPerNode"])
    env["PET_NNODES"] = f"{elastic['minReplicas']}:{elastic['maxReplicas']}"
    if elastic.get("rdzvBackend"):
        env["PET_RDZV_BACKEND"] = elastic["rdzvBackend"]
    host = elastic.get("rdzvHost") or f"{name}-worker-0"
    port = elastic.get("rdzvPort") or DEFAULT_PYTORCHJOB_PORT
    env["PET_RDZV_ENDPOINT"] = f"{host}:{port}"
    if elastic.get("maxRestarts") is not None:
        env["PET_MAX_RESTARTS"] = str(elastic["maxRestarts"])
    if elastic.get("rdzvId"):
        env["PET_RDZV_ID"] = elastic["rdzvId"]
    if elastic.get("rdzvConf"):
        env["PET_RDZV_CONF"] = ",".join(f"{c['key']}={c['value']}" for c in elastic["rdzvConf"])
    return env


def exit_code_policy_retries(code: int) -> bool:
    """Kubeflow's ``ExitCode`` restart policy: 1-127 permanent, 128-255 retried."""
    return 128 <= code <= 255


class Pods:
    """Worker "pods" (agents) of one rendered job; every process tree is killed at the end."""

    def __init__(self, job: dict[str, Any], tmp: Path, dns: dict[str, str]) -> None:
        self.job, self.tmp, self.dns = job, tmp, dns
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        # The job Secret's volume, as a local directory (what the kubelet mounts).
        secret = tmp / "job-secret"
        secret.mkdir()
        (secret / "secret").write_text("operator-env-" + os.urandom(16).hex())
        (secret / "secret").chmod(0o440)
        self.mounts = Mounts({"/var/run/flexrun/secret": secret})

    def start(self, index: int) -> subprocess.Popen[bytes]:
        name = f"{self.job['metadata']['name']}-worker-{index}"
        worker = self.job["spec"]["pytorchReplicaSpecs"]["Worker"]
        (container,) = worker["template"]["spec"]["containers"]
        assert container["command"] == ["flexrun", "run"]
        fields = {"status.podIP": "127.0.0.1", "metadata.name": name}
        cenv = {k: self.mounts.rewrite(v) for k, v in container_env(container, fields).items()}
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
        env.update(operator_env(self.job))
        host, port = env["PET_RDZV_ENDPOINT"].rsplit(":", 1)
        env["PET_RDZV_ENDPOINT"] = f"{self.dns[host]}:{port}"  # cluster DNS
        env.update(cenv)
        args = [expand(a, cenv) for a in container["args"]]
        cwd = self.tmp / name
        cwd.mkdir()
        with open(cwd / "agent.log", "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "flexrun", "run", *args],
                env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.tmp / name / "agent.log").read_text(errors="replace")[-3000:]

    def cleanup(self) -> None:
        # Workers run in process groups of their own: collect the trees before killing.
        tree: list[psutil.Process] = []
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(psutil.NoSuchProcess):
                    tree += psutil.Process(proc.pid).children(recursive=True)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        for child in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()


@pytest.fixture
def flexrun_store(tmp_path: Path) -> Iterator[int]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    with open(tmp_path / "store.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "flexrun", "store", "--host", "127.0.0.1", "--port", str(port)],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        wait_for(lambda: b"listening" in (tmp_path / "store.log").read_bytes(), 30, "the store")
        yield port
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def _worlds_since(progress: Path, ts: float) -> set[int]:
    if not progress.exists():
        return set()
    out = set()
    for line in progress.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if row["ts"] > ts:
            out.add(row["world"])
    return out


@pytest.mark.timeout(300)
def test_rendered_pods_form_one_job_survive_a_spot_reclaim_and_scale_back_up(
    tmp_path: Path, flexrun_store: int
) -> None:
    progress, marker = tmp_path / "progress.jsonl", tmp_path / "sigterm"
    spec = parse_job_spec(
        {
            "metadata": {"name": "sim"},
            "spec": {
                "image": "local",
                "script": str(DDP_STEPS),
                "args": ["--steps", "100000", "--step-time", "0.05",
                         "--progress", str(progress), "--on-sigterm", str(marker)],
                "nnodes": "1:3",
                "nprocPerNode": 1,
                "replicas": 2,
                "store": {"type": "tcp", "port": flexrun_store},
                "gracePeriodSeconds": 30,
                "maxRestarts": 3,
                "rdzvConf": {"heartbeat_interval": "0.5", "heartbeat_timeout": "3",
                             "last_call_timeout": "0.5", "join_timeout": "120"},
            },
        }
    )  # fmt: skip
    (job,) = [d for d in render(spec) if d["kind"] == "PyTorchJob"]
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["restartPolicy"] == "ExitCode"
    pods = Pods(job, tmp_path, dns={"sim-store": "127.0.0.1"})
    try:
        a, b = pods.start(0), pods.start(1)
        t0 = time.time()
        wait_for(lambda: 2 in _worlds_since(progress, t0), 120, "the two pods to form one job")

        # Spot reclaim: the kubelet sends SIGTERM to the container's main process (the agent).
        a.send_signal(signal.SIGTERM)
        t_kill = time.time()
        code = a.wait(timeout=60)
        assert code == 143, pods.log("sim-worker-0")
        assert exit_code_policy_retries(code)  # the operator re-creates the pod
        assert list(tmp_path.glob("sigterm.*")), (
            "the worker never saw SIGTERM (no final checkpoint)"
        )
        wait_for(lambda: 1 in _worlds_since(progress, t_kill + 0.5), 90, "the survivor to continue")
        assert b.poll() is None, pods.log("sim-worker-1")

        # New capacity: a new pod joins and the job grows back.
        t_join = time.time()
        c = pods.start(2)
        wait_for(lambda: 2 in _worlds_since(progress, t_join), 120, "the job to scale back up")
        assert b.poll() is None and c.poll() is None
    except AssertionError:
        for name in pods.procs:
            print(f"--- {name}\n{pods.log(name)}")
        raise
    finally:
        pods.cleanup()


def test_operator_env_for_the_rendered_job_carries_every_launcher_setting() -> None:
    spec = parse_job_spec(
        {
            "metadata": {"name": "envcheck"},
            "spec": {"image": "i", "script": "t.py", "nnodes": "2:5", "nprocPerNode": 4,
                     "store": {"type": "etcd"}, "maxRestarts": 2, "rdzvConf": {"join_timeout": "90"}},
        }
    )  # fmt: skip
    (job,) = [d for d in render(spec) if d["kind"] == "PyTorchJob"]
    assert operator_env(job) == {
        "PYTHONUNBUFFERED": "1",
        "PET_NPROC_PER_NODE": "4",
        "PET_NNODES": "2:5",
        "PET_RDZV_BACKEND": "etcd-v3",
        "PET_RDZV_ENDPOINT": "envcheck-etcd:2379",
        "PET_MAX_RESTARTS": "2",
        "PET_RDZV_ID": "envcheck",
        # etcd's TLS files from the mounted Secret (the rendered etcd requires client certs)
        "PET_RDZV_CONF": "join_timeout=90,cacert=/var/run/flexrun/etcd/ca.crt,"
        "cert=/var/run/flexrun/etcd/tls.crt,key=/var/run/flexrun/etcd/tls.key",
    }
    assert not exit_code_policy_retries(1) and exit_code_policy_retries(143)
