"""Scheduling and network fields of the job spec (``spec.scheduling``, ``spec.network``):
rendered into the Worker pods and job objects of both targets, valid against the real
schemas (Kubernetes' own through kubernetes-validate, the PyTorchJob CRD, Trainer v2.3.0's
CRDs); contradictions are one clear error naming the field."""

from __future__ import annotations

import copy
import importlib.util
import os
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from k8s_paths import EXAMPLE

from flexrun.errors import SpecError
from flexrun.k8s.render import render
from flexrun.k8s.spec import parse_job_spec
from flexrun.k8s.validate import validate_documents

pytestmark = pytest.mark.timeout(120)

SHARED = Path(
    os.environ.get("FLEXRUN_SHARED_SCHEMAS")
    or Path(__file__).resolve().parents[4] / "shared" / "schemas"
)
HAS_KV = importlib.util.find_spec("kubernetes_validate") is not None

FIELDS: dict[str, Any] = {
    "scheduling": {
        "priorityClassName": "training-high",
        "nodeSelector": {"gpu.example.com/class": "h100"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchExpressions": [{"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["a", "b"]}]}
                    ]
                }
            }
        },
        "topologySpreadConstraints": [
            {"maxSkew": 2, "topologyKey": "example.com/rack", "whenUnsatisfiable": "DoNotSchedule",
             "labelSelector": {"matchLabels": {"app.kubernetes.io/component": "worker"}}}
        ],
        "onePodPerNode": True,
        "spreadZones": True,
        "kueue": {"queueName": "team-a"},
    },
    "network": {
        "hostNetwork": True,
        "rdma": {"resource": "rdma/hca", "count": 1},
        "ncclIbHca": "mlx5",
        "ncclSocketIfname": "eth0",
    },
    "shmSize": "16Gi",
}  # fmt: skip


def _spec_doc(target: str, **extra: Any) -> dict[str, Any]:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"].update(copy.deepcopy(FIELDS), target=target, **extra)
    return doc


def _pod_and_job(docs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    kinds = {d["kind"]: d for d in docs}
    if "PyTorchJob" in kinds:
        job = kinds["PyTorchJob"]
        return job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"], job
    runtime = kinds["TrainingRuntime"]
    rjob = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]
    return rjob["template"]["spec"]["template"]["spec"], kinds["TrainJob"]


@pytest.mark.parametrize("target", ["pytorchjob", "trainjob"])
def test_every_field_is_rendered_into_the_pods_and_the_job(target: str) -> None:
    docs = render(parse_job_spec(_spec_doc(target)))
    pod, job = _pod_and_job(docs)
    assert pod["priorityClassName"] == "training-high"
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert pod["nodeSelector"] == {
        "cloud.google.com/gke-spot": "true",
        "gpu.example.com/class": "h100",
    }
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    assert any(t["key"] == "cloud.google.com/gke-spot" for t in pod["tolerations"])
    anti = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti[0]["topologyKey"] == "kubernetes.io/hostname"
    assert anti[0]["labelSelector"]["matchLabels"]["app.kubernetes.io/component"] == "worker"
    assert "nodeAffinity" in pod["affinity"]
    keys = [c["topologyKey"] for c in pod["topologySpreadConstraints"]]
    assert keys == ["example.com/rack", "topology.kubernetes.io/zone"]
    c = pod["containers"][0]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["NCCL_IB_DISABLE"] == "0" and env["NCCL_IB_HCA"] == "mlx5"
    assert env["NCCL_SOCKET_IFNAME"] == "eth0"
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    if target == "pytorchjob":
        assert c["resources"]["limits"]["rdma/hca"] == 1
        assert job["spec"]["runPolicy"]["suspend"] is True
    else:  # a TrainJob's resources are per node on the TrainJob
        assert job["spec"]["trainer"]["resourcesPerNode"]["limits"]["rdma/hca"] == 1
        assert job["spec"]["suspend"] is True


@pytest.mark.parametrize("target", ["pytorchjob", "trainjob"])
@pytest.mark.parametrize(
    "core",
    [
        False,
        pytest.param(
            True, marks=pytest.mark.skipif(not HAS_KV, reason="kubernetes-validate not installed")
        ),
    ],
)
def test_rendered_with_every_field_passes_validate(target: str, core: bool) -> None:
    docs = render(parse_job_spec(_spec_doc(target)))
    report = validate_documents(docs, use_core_schemas=core)
    assert report.problems == (), [str(p) for p in report.problems]


def test_rendered_pytorchjob_with_every_field_validates_against_the_real_crd() -> None:
    crd_file = SHARED / "kubeflow.org_pytorchjobs.yaml"
    if not crd_file.is_file():
        pytest.skip(f"{crd_file} absent (a checkout without ../shared/schemas)")
    crd = yaml.safe_load(crd_file.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    job = next(
        d for d in render(parse_job_spec(_spec_doc("pytorchjob"))) if d["kind"] == "PyTorchJob"
    )
    errors = list(jsonschema.Draft7Validator(version["schema"]["openAPIV3Schema"]).iter_errors(job))
    assert not errors, [e.message for e in errors]


def test_user_env_wins_over_the_nccl_defaults() -> None:
    doc = _spec_doc("pytorchjob")
    doc["spec"]["env"] = {"NCCL_IB_DISABLE": "1"}
    pod, _ = _pod_and_job(render(parse_job_spec(doc)))
    names = [e["name"] for e in pod["containers"][0]["env"]]
    assert names.count("NCCL_IB_DISABLE") == 1
    assert {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}[
        "NCCL_IB_DISABLE"
    ] == "1"


def test_without_the_fields_nothing_changes() -> None:
    doc = yaml.safe_load(EXAMPLE.read_text())
    pod, job = _pod_and_job(render(parse_job_spec(doc)))
    assert not {"priorityClassName", "hostNetwork", "affinity", "topologySpreadConstraints"} & set(
        pod
    )
    assert "suspend" not in job["spec"]["runPolicy"]
    assert "kueue.x-k8s.io/queue-name" not in job["metadata"]["labels"]


@pytest.mark.parametrize(
    ("block", "value", "match"),
    [
        ("scheduling", {"nodeSelector": {"cloud.google.com/gke-spot": "false"}}, r"spec\.scheduling\.nodeSelector\.cloud\.google\.com/gke-spot: .*contradicts spot\.nodeSelector"),
        ("scheduling", {"affinity": ["x"]}, r"spec\.scheduling\.affinity: must be a mapping"),
        ("scheduling", {"tolerations": ["x"]}, r"spec\.scheduling\.tolerations\[0\]: must be a mapping"),
        ("scheduling", {"kueue": {}}, r"spec\.scheduling\.kueue\.queueName"),
        ("scheduling", {"kueue": {"queueName": "Team A"}}, r"spec\.scheduling\.kueue\.queueName: 'Team A' is not a valid name"),
        ("scheduling", {"priorityClassName": "Bad_Name"}, r"spec\.scheduling\.priorityClassName"),
        ("scheduling", {"sideways": True}, r"spec\.scheduling\.sideways"),
        ("network", {"rdma": {"resource": "rdma hca"}}, r"spec\.network\.rdma\.resource"),
        ("network", {"rdma": {"count": 0}}, r"spec\.network\.rdma\.count: must be >= 1"),
        ("network", {"hostNetwork": "yes"}, r"spec\.network\.hostNetwork"),
    ],
)  # fmt: skip
def test_bad_fields_are_one_error_naming_the_field(block: str, value: Any, match: str) -> None:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"][block] = value
    with pytest.raises(SpecError, match=match) as info:
        parse_job_spec(doc)
    assert "\n" not in str(info.value)
