"""Rehearsal of a rendered TrainJob without a cluster: 3 pods, one lost and recreated.

Every "pod" is a ``flexrun run`` started with exactly what its TrainJob pod would get:

- the ``node`` container's command and args, after Trainer applied the TrainJob to the
  rendered runtime (the TrainJob's ``trainer.args`` name the script);
- the environment the v2.3.0 torch plugin and the Job controller inject (static
  ``PET_NNODES=3``, ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK`` and ``JOB_COMPLETION_INDEX``
  = the completion index, ``PET_MASTER_ADDR=<job>-node-0-0.<job>``, ``PET_MASTER_PORT``)
  plus the container's own env, ``$(POD_IP)`` expanded as the kubelet does;
- the volume mounts as local directories: the checkpoint PVC shared by all pods, the job
  Secret (mode 0440, as the rendered volume makes it);
- cluster DNS: the store Service's name -> the rendered store container, run as its
  Deployment would run it (``flexrun store --host $(POD_IP) --port P``) with a pod IP of
  its own on loopback (127.0.0.2). The rendered workers say `--rdzv-conf is_host=false`, so
  none of them hosts the store although a loopback address looks like its own (torchrun's rule).

The training script is flexrun's chaos workload (``ElasticSampler`` + ``Checkpointer``;
it logs every sample index each rank consumes). One pod is lost (kill -9 of its agent and
workers: the container exits 137, which the rendered pod failure policy counts and the
Job controller answers by recreating that pod with the same completion index). The test
checks that the two others never stopped (their agents stay up and they commit steps at
world size 2 before the replacement exists), that the replacement rejoins (world size 3
again), and that the job finishes, every pod exiting 0, with every sample consumed
exactly once (``flexrun.testing.invariants``).
"""

from __future__ import annotations

import contextlib
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
from k8s_pods import (
    Dns,
    Mounts,
    container_env,
    effective_trainer_container,
    expand,
    torch_plugin_env,
)
from support import free_port, wait_for

from flexrun.k8s.render import render
from flexrun.k8s.spec import parse_job_spec
from flexrun.testing.invariants import CheckResult, check_exactly_once, read_step_logs

JOB = "rh"
STORE_POD_IP = "127.0.0.2"
STEPS, SAMPLES, GLOBAL_BATCH = 400, 240, 24
Doc = dict[str, Any]


def _spec(store_port: int) -> Doc:
    return {
        "metadata": {"name": JOB},
        "spec": {
            "target": "trainjob",
            "image": "local",
            "module": "flexrun.testing.chaos_workload",
            "args": [
                "--steps", str(STEPS), "--samples", str(SAMPLES),
                "--global-batch", str(GLOBAL_BATCH), "--micro-batch", "8",
                "--ckpt-dir", "/checkpoints/ckpt", "--ckpt-every", "5",
                "--log-dir", "/checkpoints/steps", "--step-sleep", "0.08",
            ],
            "nnodes": "2:3",
            "replicas": 3,
            "nprocPerNode": 1,
            "checkpoint": {"mountPath": "/checkpoints", "size": "1Gi"},
            "store": {"type": "tcp", "port": store_port},
            "gracePeriodSeconds": 30,
            "maxRestarts": 3,
            "rdzvConf": {
                "heartbeat_interval": "0.5", "heartbeat_timeout": "3",
                "last_call_timeout": "0.5", "join_timeout": "180",
            },
        },
    }  # fmt: skip


class Cluster:
    """The rendered objects' pods as local processes; every process tree dies at the end."""

    def __init__(self, docs: list[Doc], root: Path) -> None:
        self.kinds = {d["kind"]: d for d in docs}
        self.root = root
        self.pvc = root / "pvc"
        self.pvc.mkdir()
        secret = root / "job-secret"
        secret.mkdir()
        (secret / "secret").write_text("rehearsal-" + os.urandom(16).hex())
        (secret / "secret").chmod(0o440)  # what the rendered secret volume makes of it
        self.mounts = Mounts({"/checkpoints": self.pvc, "/var/run/flexrun/secret": secret})
        svc = self.kinds["Service"]
        port = svc["spec"]["ports"][0]["port"]
        self.dns = Dns({(svc["metadata"]["name"], port): (STORE_POD_IP, port)})
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.envs: dict[str, dict[str, str]] = {}
        self.argvs: dict[str, list[str]] = {}
        self.tree: set[int] = set()
        self.created = 0

    def _base_env(self) -> dict[str, str]:
        drop = ("PET_", "TORCHELASTIC_", "FLEXRUN_", "MASTER_", "JOB_COMPLETION")
        return {k: v for k, v in os.environ.items() if not k.startswith(drop)}

    def _start(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        cwd = self.root / name  # a fresh container filesystem per pod
        cwd.mkdir()
        assert argv[0] == "flexrun", argv
        with open(cwd / "pod.log", "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "flexrun", *argv[1:]],
                env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        self.procs[name] = proc
        self.envs[name], self.argvs[name] = env, argv
        return proc

    def start_store(self) -> None:
        (c,) = self.kinds["Deployment"]["spec"]["template"]["spec"]["containers"]
        cenv = container_env(c, {"status.podIP": STORE_POD_IP})
        argv = [expand(a, cenv) for a in c["command"]]
        self._start("store", argv, {**self._base_env(), **cenv})
        wait_for(lambda: b"listening" in self.log_bytes("store"), 60, "the store")

    def start_pod(self, index: int) -> tuple[str, subprocess.Popen[bytes]]:
        """Pod ``index`` of the TrainJob (a new pod each call, as JobSet recreates it)."""
        runtime, job = self.kinds["TrainingRuntime"], self.kinds["TrainJob"]
        container = effective_trainer_container(runtime, job)
        self.created += 1
        name = f"{JOB}-node-0-{index}-{self.created:05d}"
        cenv = container_env(container, {"status.podIP": "127.0.0.1", "metadata.name": name})
        cenv = {k: self.mounts.rewrite(v) for k, v in cenv.items()}
        env = {**self._base_env(), **torch_plugin_env(runtime, job, index), **cenv}
        argv = [*container["command"], *container.get("args", [])]
        argv = [self.mounts.rewrite(self.dns.rewrite(expand(a, cenv))) for a in argv]
        return name, self._start(name, argv, env)

    def kill_pod(self, name: str) -> int:
        """The pod is lost with its node: SIGKILL to the agent and every worker."""
        proc = self.procs[name]
        victims = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        for p in victims:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        code = proc.wait(timeout=30)
        wait_for(lambda: not any(p.is_running() and p.status() != "zombie" for p in victims), 30,
                  "the killed pod's processes to be gone")  # fmt: skip
        return code

    def log_bytes(self, name: str) -> bytes:
        path = self.root / name / "pod.log"
        return path.read_bytes() if path.exists() else b""

    def logs(self) -> str:
        return "\n".join(
            f"--- {n}\n{self.log_bytes(n).decode(errors='replace')[-2500:]}" for n in self.procs
        )

    def remember_tree(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                with contextlib.suppress(psutil.NoSuchProcess):
                    self.tree.update(c.pid for c in psutil.Process(p.pid).children(recursive=True))

    def cleanup(self) -> None:
        self.remember_tree()
        for p in self.procs.values():
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
        for pid in sorted(self.tree):
            with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
                psutil.Process(pid).kill()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    docs = render(parse_job_spec(_spec(free_port())))
    c = Cluster(docs, tmp_path)
    try:
        yield c
    finally:
        c.cleanup()


def _lines(pvc: Path) -> list[Doc]:
    return [r for r in read_step_logs(pvc / "steps") if "step" in r and "ids" in r]


def _worlds_since(pvc: Path, ts: float) -> set[int]:
    return {int(r["world"]) for r in _lines(pvc) if r["ts"] > ts}


def _pod_failure_action(runtime: Doc, exit_code: int) -> str:
    (job,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    for rule in job["template"]["spec"]["podFailurePolicy"]["rules"]:
        codes = rule.get("onExitCodes")
        if codes and (exit_code in codes["values"]) == (codes["operator"] == "In"):
            return str(rule["action"])
    return "Count"


@pytest.mark.timeout(600)
def test_three_pods_one_lost_and_recreated_with_its_index_trains_every_sample_once(
    cluster: Cluster,
) -> None:
    pvc = cluster.pvc
    try:
        cluster.start_store()
        pods = {i: cluster.start_pod(i) for i in range(3)}
        t0 = time.time()
        wait_for(lambda: 3 in _worlds_since(pvc, t0), 240, "the 3 pods to train as one job")

        # Pod 1 is lost with its node. Its container exits 137; the rendered pod failure
        # policy counts it (backoffLimit) and the Job recreates the pod, same index.
        lost_name, lost = pods[1]
        code = cluster.kill_pod(lost_name)
        t_kill = time.time()
        assert code == -signal.SIGKILL
        assert (
            _pod_failure_action(cluster.kinds["TrainingRuntime"], 128 + signal.SIGKILL) == "Count"
        )

        # The others never stop: their agents stay up and they commit steps at world 2.
        def survivors_trained() -> bool:
            return len([r for r in _lines(pvc) if r["ts"] > t_kill and r["world"] == 2]) >= 2 * 3

        wait_for(survivors_trained, 180, "the two other pods to keep training")
        for i in (0, 2):
            assert pods[i][1].poll() is None, cluster.logs()

        # JobSet/Job recreate pod 1: a new pod, same completion index.
        name, replacement = cluster.start_pod(1)
        t_back = time.time()
        wait_for(lambda: 3 in _worlds_since(pvc, t_back), 240, "the replacement to rejoin")
        for i in (0, 2):
            assert pods[i][1].poll() is None, cluster.logs()

        cluster.remember_tree()
        codes = {}
        for label, proc in [("0", pods[0][1]), ("2", pods[2][1]), ("1 (recreated)", replacement)]:
            codes[label] = proc.wait(timeout=300)
        assert codes == {"0": 0, "2": 0, "1 (recreated)": 0}, cluster.logs()
    except AssertionError:
        print(cluster.logs())
        raise

    records = read_step_logs(pvc / "steps")
    result = CheckResult()
    check_exactly_once(
        records, steps=STEPS, samples=SAMPLES, global_batch=GLOBAL_BATCH, result=result
    )
    assert result.ok, result.to_dict()
    # Survivors' lines between the loss and the replacement's return: training went on.
    gap = [r for r in records if "ids" in r and t_kill < r["ts"] < t_back]
    assert gap and {int(r["world"]) for r in gap} >= {2}
    # The replacement really is index 1 (what the torch plugin and the Job controller
    # inject for it), and it ran the very command line the lost pod ran.
    env = cluster.envs[name]
    assert (env["PET_NODE_RANK"], env["JOB_COMPLETION_INDEX"], env["PET_NNODES"]) == ("1", "1", "3")
    assert cluster.argvs[name] == cluster.argvs[lost_name]
