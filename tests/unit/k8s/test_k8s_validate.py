"""``validate``: the example passes; broken manifests fail with the field named.

These use only flexrun's own derived rules (and kubernetes-validate when installed); the
checks against Kubeflow's real CRD file are in ``test_k8s_shared_crd.py``.
"""

from __future__ import annotations

import copy
import importlib.util
from collections.abc import Callable
from typing import Any

import pytest
from k8s_paths import EXAMPLE, GOLDEN

from flexrun.errors import SpecError
from flexrun.k8s.render import render
from flexrun.k8s.spec import load_job_spec
from flexrun.k8s.validate import parse_documents, validate_documents, validate_file

pytestmark = pytest.mark.timeout(60)

HAS_KV = importlib.util.find_spec("kubernetes_validate") is not None
needs_kv = pytest.mark.skipif(not HAS_KV, reason="kubernetes-validate not installed")
MODES = [
    pytest.param(False, id="structural"),
    pytest.param(True, id="core-schemas", marks=needs_kv),
]

Doc = dict[str, Any]


def _example() -> list[Doc]:
    return render(load_job_spec(EXAMPLE))


def _job(docs: list[Doc]) -> Doc:
    return next(d for d in docs if d["kind"] == "PyTorchJob")


def _worker(job: Doc) -> Doc:
    return job["spec"]["pytorchReplicaSpecs"]["Worker"]


@pytest.mark.parametrize("core", MODES)
@pytest.mark.parametrize("source", ["example", "tcp", "etcd", "objstore"])
def test_rendered_manifests_are_valid(source: str, core: bool) -> None:
    path = EXAMPLE if source == "example" else GOLDEN / f"{source}.job.yaml"
    report = validate_documents(render(load_job_spec(path)), use_core_schemas=core)
    assert report.problems == (), [str(p) for p in report.problems]
    assert report.ok and len(report.checked) >= 4


def test_golden_files_validate_from_disk() -> None:
    for name in ("tcp.yaml", "etcd.yaml", "objstore.yaml"):
        assert validate_file(GOLDEN / name).ok


def _master_with_2_replicas(job: Doc) -> None:
    master = copy.deepcopy(_worker(job))
    master["replicas"] = 2
    job["spec"]["pytorchReplicaSpecs"]["Master"] = master


BROKEN: dict[str, tuple[Callable[[Doc], None], str, str]] = {
    "master_replicas_2": (
        _master_with_2_replicas,
        "spec.pytorchReplicaSpecs.Master.replicas",
        "exactly 1 Master",
    ),
    "missing_pytorch_container": (
        lambda j: _worker(j)["template"]["spec"]["containers"][0].update(name="trainer"),
        "spec.pytorchReplicaSpecs.Worker.template.spec.containers",
        "no container named 'pytorch'",
    ),
    "bad_restart_policy": (
        lambda j: _worker(j).update(restartPolicy="Sometimes"),
        "spec.pytorchReplicaSpecs.Worker.restartPolicy",
        "'Sometimes' not one of Always, OnFailure, Never, ExitCode",
    ),
    "min_greater_than_max": (
        lambda j: j["spec"]["elasticPolicy"].update(minReplicas=9, maxReplicas=2),
        "spec.elasticPolicy",
        "minReplicas 9 > maxReplicas 2",
    ),
    "missing_image": (
        lambda j: _worker(j)["template"]["spec"]["containers"][0].pop("image"),
        "spec.pytorchReplicaSpecs.Worker.template.spec.containers[0].image",
        "image is required",
    ),
    "zero_workers": (
        lambda j: _worker(j).update(replicas=0),
        "spec.pytorchReplicaSpecs.Worker.replicas",
        "at least 1",
    ),
    "unknown_replica_type": (
        lambda j: j["spec"]["pytorchReplicaSpecs"].update(Chief=copy.deepcopy(_worker(j))),
        "spec.pytorchReplicaSpecs.Chief",
        "not one of Master, Worker",
    ),
    "elastic_without_worker": (
        lambda j: j["spec"]["pytorchReplicaSpecs"].update(
            Master=dict(copy.deepcopy(j["spec"]["pytorchReplicaSpecs"].pop("Worker")), replicas=1)
        ),
        "spec.elasticPolicy",
        "requires a Worker",
    ),
    "nproc_per_node_conflict": (
        lambda j: j["spec"]["elasticPolicy"].update(nProcPerNode=8),
        "spec.elasticPolicy.nProcPerNode",
        "cannot be set together with spec.nprocPerNode",
    ),
    "bad_rdzv_backend": (
        lambda j: j["spec"]["elasticPolicy"].update(rdzvBackend="zookeeper"),
        "spec.elasticPolicy.rdzvBackend",
        "'zookeeper' not one of",
    ),
    "bad_clean_pod_policy": (
        lambda j: j["spec"]["runPolicy"].update(cleanPodPolicy="Sometimes"),
        "spec.runPolicy.cleanPodPolicy",
        "not one of All, Running, None",
    ),
    "unknown_spec_field": (
        lambda j: j["spec"].update(elasticPolicyy={}),
        "spec.elasticPolicyy",
        "unknown field",
    ),
    "unknown_container_field": (
        lambda j: _worker(j)["template"]["spec"]["containers"][0].update(imagee="x"),
        "spec.pytorchReplicaSpecs.Worker.template.spec.containers[0].imagee",
        "unknown field",
    ),
    "string_max_replicas": (
        lambda j: j["spec"]["elasticPolicy"].update(maxReplicas="8"),
        "spec.elasticPolicy.maxReplicas",
        "is not of type 'integer'",
    ),
    "bad_nproc_per_node": (
        lambda j: j["spec"].update(nprocPerNode="eight"),
        "spec.nprocPerNode",
        "does not match",
    ),
    "bad_job_name": (
        lambda j: j["metadata"].update(name="My_Job"),
        "metadata.name",
        "DNS-1035",
    ),
}


@pytest.mark.parametrize("core", MODES)
@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_pytorchjob_is_rejected_with_the_field_named(case: str, core: bool) -> None:
    mutate, path, message = BROKEN[case]
    docs = _example()
    mutate(_job(docs))
    report = validate_documents(docs, use_core_schemas=core)
    assert not report.ok
    found = [str(p) for p in report.errors]
    assert any(p.path == path and message in p.message for p in report.errors), found


@needs_kv
def test_pod_template_is_checked_against_kubernetes_schemas_when_available() -> None:
    docs = _example()
    pod = _worker(_job(docs))["template"]["spec"]
    pod["affinity"] = {"nodeAfinity": {}}  # a typo only Kubernetes' schema knows
    report = validate_documents(docs)
    assert [p.path for p in report.errors] == [
        "spec.pytorchReplicaSpecs.Worker.template.spec.affinity.nodeAfinity"
    ]


def test_structural_mode_says_what_it_did_not_check() -> None:
    report = validate_documents(_example(), use_core_schemas=False)
    assert any("structural checks only" in n and "kubernetes-validate" in n for n in report.notes)


def test_elastic_job_without_exitcode_policy_gets_a_warning_not_an_error() -> None:
    docs = _example()
    _worker(_job(docs))["restartPolicy"] = "OnFailure"
    report = validate_documents(docs)
    assert report.ok
    assert any(
        not p.error and p.path.endswith("Worker.restartPolicy") and "143" in p.message
        for p in report.problems
    )


def test_hand_set_pet_variable_gets_a_warning() -> None:
    docs = _example()
    _worker(_job(docs))["template"]["spec"]["containers"][0]["env"].append(
        {"name": "PET_NNODES", "value": "1:2"}
    )
    report = validate_documents(docs)
    assert report.ok
    assert any("PET_NNODES is injected by the operator" in p.message for p in report.problems)


CORE_BROKEN: dict[str, tuple[str, Callable[[Doc], None], str]] = {
    "deployment_selector_mismatch": (
        "Deployment",
        lambda d: d["spec"]["selector"]["matchLabels"].update(tier="other"),
        "spec.template.metadata.labels",
    ),
    "deployment_container_without_image": (
        "Deployment",
        lambda d: d["spec"]["template"]["spec"]["containers"][0].pop("image"),
        "spec.template.spec.containers[0].image",
    ),
    "service_bad_port": (
        "Service",
        lambda d: d["spec"]["ports"][0].update(port=70000),
        "spec.ports[0].port",
    ),
    "pvc_bad_access_mode": (
        "PersistentVolumeClaim",
        lambda d: d["spec"].update(accessModes=["ReadWriteSometimes"]),
        "spec.accessModes[0]",
    ),
    "pvc_without_size": (
        "PersistentVolumeClaim",
        lambda d: d["spec"].pop("resources"),
        "spec.resources.requests.storage",
    ),
}


@pytest.mark.parametrize("core", MODES)
@pytest.mark.parametrize("case", sorted(CORE_BROKEN))
def test_broken_core_object_is_rejected_with_the_field_named(case: str, core: bool) -> None:
    kind, mutate, path = CORE_BROKEN[case]
    docs = _example()
    mutate(next(d for d in docs if d["kind"] == kind))
    report = validate_documents(docs, use_core_schemas=core)
    assert any(p.path == path for p in report.errors), [str(p) for p in report.problems]


def test_statefulset_without_service_name_is_rejected() -> None:
    docs = render(load_job_spec(GOLDEN / "etcd.job.yaml"))
    next(d for d in docs if d["kind"] == "StatefulSet")["spec"].pop("serviceName")
    report = validate_documents(docs, use_core_schemas=False)
    assert [p.path for p in report.errors] == ["spec.serviceName"]


@needs_kv
def test_unknown_field_in_core_object_is_rejected_by_kubernetes_schema() -> None:
    docs = _example()
    next(d for d in docs if d["kind"] == "Service")["spec"]["portz"] = []
    report = validate_documents(docs)
    assert [(p.obj, p.path, p.message) for p in report.errors] == [
        ("Service/resnet50-store", "spec.portz", "unknown field")
    ]


def test_document_without_kind_and_unknown_kinds() -> None:
    docs = parse_documents("a: 1\n---\napiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\n")
    report = validate_documents(docs, use_core_schemas=False)
    assert [p.path for p in report.errors] == ["kind"]
    assert any(not p.error and "ConfigMap not checked" in p.message for p in report.problems)


def test_list_documents_are_flattened() -> None:
    docs = parse_documents("kind: List\nitems:\n- {kind: Service, metadata: {name: s}}\n")
    assert docs == [{"kind": "Service", "metadata": {"name": "s"}}]


def test_bad_files_raise_spec_error(tmp_path: Any) -> None:
    with pytest.raises(SpecError, match="cannot read"):
        validate_file(tmp_path / "nope.yaml")
    empty = tmp_path / "empty.yaml"
    empty.write_text("---\n")
    with pytest.raises(SpecError, match="no Kubernetes objects"):
        validate_file(empty)
    broken = tmp_path / "broken.yaml"
    broken.write_text("kind: [\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        validate_file(broken)
