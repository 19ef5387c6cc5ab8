"""Rendering: golden files for both stores, and the properties the operator relies on.

Regenerate the golden files after an intended change with
``FLEXRUN_UPDATE_GOLDEN=1 pytest tests/unit/k8s/test_k8s_render.py`` and review the diff.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import yaml
from k8s_paths import EXAMPLE, GOLDEN

from flexrun.k8s.render import render, to_yaml
from flexrun.k8s.spec import OPERATOR_ENV, load_job_spec

pytestmark = pytest.mark.timeout(30)


def _by_kind(docs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for d in docs:
        out.setdefault(d["kind"], []).append(d)
    return out


@pytest.mark.parametrize("store", ["tcp", "etcd", "objstore"])
def test_rendered_yaml_matches_golden_file(store: str) -> None:
    text = to_yaml(render(load_job_spec(GOLDEN / f"{store}.job.yaml")))
    golden = GOLDEN / f"{store}.yaml"
    if os.environ.get("FLEXRUN_UPDATE_GOLDEN") == "1":
        golden.write_text(text, encoding="utf-8")
    assert text == golden.read_text(encoding="utf-8"), (
        f"{golden.name} differs; if intended, regenerate with FLEXRUN_UPDATE_GOLDEN=1"
    )


def test_yaml_round_trips_and_has_no_aliases() -> None:
    docs = render(load_job_spec(EXAMPLE))
    text = to_yaml(docs)
    assert "&id" not in text and "*id" not in text
    assert list(yaml.safe_load_all(text)) == docs


def test_tcp_store_is_a_flexrun_store_deployment_and_service() -> None:
    kinds = _by_kind(render(load_job_spec(GOLDEN / "tcp.job.yaml")))
    (deploy,) = kinds["Deployment"]
    (svc,) = kinds["Service"]
    (job,) = kinds["PyTorchJob"]
    container = deploy["spec"]["template"]["spec"]["containers"][0]
    # It listens on its pod IP (the Service's endpoint), not every interface.
    assert container["command"] == ["flexrun", "store", "--host", "$(POD_IP)", "--port", "29400"]
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in (
        container["env"]
    )
    assert deploy["spec"]["replicas"] == 1 and deploy["spec"]["strategy"] == {"type": "Recreate"}
    assert svc["spec"]["selector"] == deploy["spec"]["template"]["metadata"]["labels"]
    elastic = job["spec"]["elasticPolicy"]
    assert (elastic["rdzvHost"], elastic["rdzvPort"]) == (svc["metadata"]["name"], 29400)
    assert elastic["rdzvBackend"] == "c10d"


def test_etcd_store_is_three_members_spread_over_hosts_and_workers_use_etcd_v3() -> None:
    kinds = _by_kind(render(load_job_spec(GOLDEN / "etcd.job.yaml")))
    (sts,) = kinds["StatefulSet"]
    services = {s["metadata"]["name"]: s for s in kinds["Service"]}
    (job,) = kinds["PyTorchJob"]
    assert sts["spec"]["replicas"] == 3
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    assert services[sts["spec"]["serviceName"]]["spec"]["clusterIP"] == "None"
    anti = sts["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    term = anti["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    cmd = " ".join(sts["spec"]["template"]["spec"]["containers"][0]["command"])
    for i in range(3):
        assert f"llm-etcd-etcd-{i}=https://llm-etcd-etcd-{i}.llm-etcd-etcd-peers:2380" in cmd
    elastic = job["spec"]["elasticPolicy"]
    assert elastic["rdzvBackend"] == "etcd-v3"
    assert elastic["rdzvHost"] in services and elastic["rdzvPort"] == 2379
    tls = "/var/run/flexrun/etcd"
    assert elastic["rdzvConf"] == [
        {"key": "join_timeout", "value": "900"},
        {"key": "cacert", "value": f"{tls}/ca.crt"},
        {"key": "cert", "value": f"{tls}/tls.crt"},
        {"key": "key", "value": f"{tls}/tls.key"},
    ]
    assert elastic["metrics"][0]["type"] == "Resource"
    assert job["spec"]["runPolicy"]["backoffLimit"] == 50


@pytest.mark.parametrize("store", ["tcp", "etcd"])
def test_store_pods_stay_off_the_spot_pool(store: str) -> None:
    spec = load_job_spec(GOLDEN / f"{store}.job.yaml")
    docs = render(spec)
    stores = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]
    assert len(stores) == 1
    pod = stores[0]["spec"]["template"]["spec"]
    assert "tolerations" not in pod  # never tolerates the spot taint
    assert "nodeSelector" not in pod
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    expressions = terms["nodeSelectorTerms"][0]["matchExpressions"]
    for key, value in spec.spot.node_selector:
        assert {"key": key, "operator": "NotIn", "values": [value]} in expressions


@pytest.mark.parametrize("store", ["tcp", "etcd"])
def test_workers_are_elastic_exitcode_spot_pods_running_flexrun_run(store: str) -> None:
    spec = load_job_spec(GOLDEN / f"{store}.job.yaml")
    (job,) = [d for d in render(spec) if d["kind"] == "PyTorchJob"]
    assert job["apiVersion"] == "kubeflow.org/v1"
    elastic = job["spec"]["elasticPolicy"]
    assert (elastic["minReplicas"], elastic["maxReplicas"]) == (spec.nnodes.min, spec.nnodes.max)
    assert elastic["rdzvId"] == spec.name and elastic["maxRestarts"] == spec.max_restarts
    assert job["spec"]["nprocPerNode"] == spec.nproc_per_node
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert list(replicas) == ["Worker"]  # elastic: no Master
    worker = replicas["Worker"]
    assert worker["restartPolicy"] == "ExitCode"
    pod = worker["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == spec.grace_period_s >= 30
    assert pod["nodeSelector"] == dict(spec.spot.node_selector)
    assert len(pod["tolerations"]) == len(spec.spot.tolerations)
    (container,) = pod["containers"]
    assert container["name"] == "pytorch" and container["image"] == spec.image
    assert container["command"] == ["flexrun", "run"]
    # Nothing the operator injects is hard-coded: no launcher flags, no PET_* variables.
    assert not any(
        a.startswith(("--nnodes", "--nproc", "--rdzv", "--max-restarts")) for a in container["args"]
    )
    assert not {e["name"] for e in container.get("env", [])} & OPERATOR_ENV
    # What the operator does not inject: the pod's own address, and a worker stop grace
    # that fits inside the pod's grace period.
    assert container["args"][:4] == [
        "--local-addr",
        "$(POD_IP)",
        "--stop-grace",
        str(spec.grace_period_s - 10),
    ]
    pod_ip = next(e for e in container["env"] if e["name"] == "POD_IP")
    assert pod_ip["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    gpu = spec.resources.gpu
    assert container["resources"]["limits"]["nvidia.com/gpu"] == gpu


def test_checkpoint_pvc_is_created_shared_and_mounted() -> None:
    docs = render(load_job_spec(GOLDEN / "tcp.job.yaml"))
    (pvc,) = [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert pvc["spec"]["resources"]["requests"]["storage"] == "1Ti"
    assert docs[0] is pvc  # created before the pods that mount it
    (job,) = [d for d in docs if d["kind"] == "PyTorchJob"]
    pod = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    vol = {v["name"]: v for v in pod["volumes"]}["checkpoints"]
    assert vol["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env["FLEXRUN_CHECKPOINT_DIR"] == "/ckpt"


def test_existing_claim_creates_no_pvc() -> None:
    docs = render(load_job_spec(GOLDEN / "etcd.job.yaml"))
    assert not [d for d in docs if d["kind"] == "PersistentVolumeClaim"]


def test_rendering_is_deterministic() -> None:
    spec = load_job_spec(EXAMPLE)
    assert to_yaml(render(spec)) == to_yaml(render(spec))
