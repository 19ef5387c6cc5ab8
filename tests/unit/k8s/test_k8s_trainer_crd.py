"""Against Kubeflow Trainer v2.3.0's real CRDs (``../shared/schemas/trainer-v2.3.0``).

Skipped when that folder is absent (a checkout outside CI). The project ships the CRDs'
schemas as package data (``flexrun/k8s/schemas/trainer-v2.3.0.json``); these tests keep
the two honest: the shipped data is the CRDs' ``openAPIV3Schema`` (regenerate it with
``FLEXRUN_UPDATE_SCHEMAS=1``), every CEL rule has a translation, rendered TrainJobs and
runtimes pass the real schemas, and the controller-only rules are shown to be needed
(the CRDs alone accept those broken manifests).
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from k8s_paths import GOLDEN, TRAINER_CRDS, TRAINJOB_EXAMPLE

from flexrun.k8s import _trainer_schema
from flexrun.k8s.render import render
from flexrun.k8s.spec import load_job_spec
from flexrun.k8s.validate import validate_documents

pytestmark = pytest.mark.timeout(120)

Doc = dict[str, Any]
CRD_FILES = {
    "TrainJob": "trainer.kubeflow.org_trainjobs.yaml",
    "TrainingRuntime": "trainer.kubeflow.org_trainingruntimes.yaml",
    "ClusterTrainingRuntime": "trainer.kubeflow.org_clustertrainingruntimes.yaml",
}
SHIPPED = Path(_trainer_schema.__file__).parent / "schemas" / _trainer_schema.SCHEMA_FILE


def _strip(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _strip(v) for k, v in node.items() if k != "description"}
    if isinstance(node, list):
        return [_strip(v) for v in node]
    return node


@pytest.fixture(scope="module")
def crds() -> dict[str, Doc]:
    """Kind -> the real CRD's v1alpha1 openAPIV3Schema."""
    if not TRAINER_CRDS.is_dir():
        pytest.skip(f"{TRAINER_CRDS} absent: the Trainer CRDs are only present in CI checkouts")
    out = {}
    for kind, name in CRD_FILES.items():
        crd = yaml.safe_load((TRAINER_CRDS / name).read_text(encoding="utf-8"))
        assert crd["spec"]["names"]["kind"] == kind
        (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
        out[kind] = version["schema"]["openAPIV3Schema"]
    return out


def test_shipped_schemas_are_the_v2_3_0_crds(crds: dict[str, Doc]) -> None:
    wanted = {k: _strip(v) for k, v in crds.items()}
    # The package stores TrainingRuntime's once: ClusterTrainingRuntime's is identical.
    assert wanted["ClusterTrainingRuntime"] == wanted["TrainingRuntime"]
    shipped = _trainer_schema.shipped()
    if os.environ.get("FLEXRUN_UPDATE_SCHEMAS") == "1":
        doc = dict(shipped)
        doc["schemas"] = {k: wanted[k] for k in ("TrainJob", "TrainingRuntime")}
        SHIPPED.write_text(json.dumps(doc, sort_keys=True, separators=(",", ":")) + "\n")
        _trainer_schema.shipped.cache_clear()
        shipped = _trainer_schema.shipped()
    assert shipped["version"] == "v2.3.0" and "kubeflow/trainer" in shipped["source"]
    assert shipped["schemas"] == {k: wanted[k] for k in ("TrainJob", "TrainingRuntime")}


def test_every_cel_rule_of_the_crds_has_a_translation(crds: dict[str, Doc]) -> None:
    rules = {r for schema in crds.values() for r in _trainer_schema.cel_rules_in(schema)}
    assert rules, "the CRDs have CEL rules; finding none means the walk is broken"
    assert sorted(rules - set(_trainer_schema.CEL_RULES)) == []


def _crd_errors(schema: Doc, doc: Doc) -> list[str]:
    validator = jsonschema.Draft7Validator(schema)
    return [
        f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)
    ]


SOURCES = {
    "trainjob": GOLDEN / "trainjob.job.yaml",
    "trainjob-etcd": GOLDEN / "trainjob-etcd.job.yaml",
    "trainjob-objstore": GOLDEN / "trainjob-objstore.job.yaml",
    "example": TRAINJOB_EXAMPLE,
}


@pytest.mark.parametrize("source", sorted(SOURCES))
@pytest.mark.parametrize("runtime_kind", ["TrainingRuntime", "ClusterTrainingRuntime"])
def test_rendered_trainjob_and_runtime_validate_against_the_real_crds(
    crds: dict[str, Doc], source: str, runtime_kind: str
) -> None:
    docs = render(load_job_spec(SOURCES[source], runtime_kind=runtime_kind))
    trainer = [d for d in docs if d["kind"] in CRD_FILES]
    assert sorted(d["kind"] for d in trainer) == sorted(["TrainJob", runtime_kind])
    for doc in trainer:
        assert _crd_errors(crds[doc["kind"]], doc) == [], doc["kind"]
    report = validate_documents(docs)
    assert report.problems == (), [str(p) for p in report.problems]


def _chart_runtime() -> Doc:
    """The chart's torch-distributed runtime, its Helm template lines removed."""
    text = (TRAINER_CRDS / "example-torch-distributed-runtime.yaml").read_text(encoding="utf-8")
    return yaml.safe_load("\n".join(line for line in text.splitlines() if "{{" not in line))


def test_a_torchrun_trainjob_on_the_charts_runtime_validates_and_runs_flexrun_static(
    crds: dict[str, Doc],
) -> None:
    runtime = _chart_runtime()
    assert _crd_errors(crds["ClusterTrainingRuntime"], runtime) == []
    job = {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": {"name": "static-job", "namespace": "ml"},
        "spec": {
            "runtimeRef": {"name": "torch-distributed"},  # kind defaults to the cluster one
            "trainer": {
                "image": "registry.example.com/ml/llm:2.1",
                "command": ["flexrun", "run", "/app/train.py"],  # instead of torchrun
                "numNodes": 4,
            },
        },
    }
    assert _crd_errors(crds["TrainJob"], job) == []
    assert validate_documents([runtime, job]).problems == ()
    alone = validate_documents([job])
    assert [p.path for p in alone.errors] == ["spec.runtimeRef.name"]
    installed = validate_documents(
        [job], installed_runtimes=["ClusterTrainingRuntime/torch-distributed"]
    )
    assert installed.problems == ()


def _rendered() -> list[Doc]:
    return render(load_job_spec(GOLDEN / "trainjob.job.yaml"))


def _runtime(docs: list[Doc]) -> Doc:
    return next(d for d in docs if d["kind"] == "TrainingRuntime")


def _trainjob(docs: list[Doc]) -> Doc:
    return next(d for d in docs if d["kind"] == "TrainJob")


def _pod(docs: list[Doc]) -> Doc:
    job = _runtime(docs)["spec"]["template"]["spec"]["replicatedJobs"][0]
    return job["template"]["spec"]["template"]["spec"]


NODE_JOB = "spec.template.spec.replicatedJobs[0]"
CONTAINERS = f"{NODE_JOB}.template.spec.template.spec.containers"

#: case -> (what breaks, object kind, path reported, a word of the message, does the CRD
#: schema alone catch it)
BROKEN: dict[str, tuple[Callable[[list[Doc]], None], str, str, str, bool]] = {
    "num_nodes_wrong_type": (
        lambda d: _trainjob(d)["spec"]["trainer"].update(numNodes="4"),
        "TrainJob",
        "spec.trainer.numNodes",
        "is not of type 'integer'",
        True,
    ),
    "image_wrong_type": (
        lambda d: _pod(d)["containers"][0].update(image=7),
        "TrainingRuntime",
        f"{CONTAINERS}[0].image",
        "is not of type 'string'",
        True,
    ),
    "missing_node_container": (
        lambda d: _pod(d)["containers"][0].update(name="trainer"),
        "TrainingRuntime",
        CONTAINERS,
        "no container named 'node'",
        False,
    ),
    "unknown_runtime_reference": (
        lambda d: _trainjob(d)["spec"]["runtimeRef"].update(name="no-such-runtime"),
        "TrainJob",
        "spec.runtimeRef.name",
        "unknown runtime reference",
        False,
    ),
    "runtime_kind_mismatch": (
        lambda d: _trainjob(d)["spec"]["runtimeRef"].update(kind="ClusterTrainingRuntime"),
        "TrainJob",
        "spec.runtimeRef.name",
        "ClusterTrainingRuntime/llm-tj-runtime is not among these manifests",
        False,
    ),
    "no_torch_policy": (
        lambda d: _runtime(d)["spec"]["mlPolicy"].pop("torch"),
        "TrainingRuntime",
        "spec.mlPolicy.torch",
        "is required",
        False,
    ),
    "num_nodes_above_the_node_range": (
        lambda d: _trainjob(d)["spec"]["trainer"].update(numNodes=9),
        "TrainJob",
        "spec.trainer.numNodes",
        "outside the runtime's flexrun run --nnodes 2:4",
        False,
    ),
    "num_nodes_below_the_node_range": (
        lambda d: _trainjob(d)["spec"]["trainer"].update(numNodes=1),
        "TrainJob",
        "spec.trainer.numNodes",
        "could never start",
        False,
    ),
    "unknown_field": (
        lambda d: _trainjob(d)["spec"]["trainer"].update(numNode=4),
        "TrainJob",
        "spec.trainer.numNode",
        "unknown field",
        False,
    ),
    "two_policies": (
        lambda d: _runtime(d)["spec"]["mlPolicy"].update(mpi={}),
        "TrainingRuntime",
        "spec.mlPolicy",
        "Only one of the policy",
        False,  # a CEL rule: plain JSON Schema cannot run it, flexrun translates it
    ),
    "pod_failure_policy_with_on_failure": (
        lambda d: _pod(d).update(restartPolicy="OnFailure"),
        "TrainingRuntime",
        f"{NODE_JOB}.template.spec.template.spec.restartPolicy",
        "needs restartPolicy Never",
        False,
    ),
    "unsorted_exit_codes": (
        lambda d: _runtime(d)["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"][
            "podFailurePolicy"
        ]["rules"][3]["onExitCodes"].update(values=[200, 137]),
        "TrainingRuntime",
        f"{NODE_JOB}.template.spec.podFailurePolicy.rules[3].onExitCodes.values",
        "sorted ascending",
        False,
    ),
    "failure_rule_name_with_dash": (
        lambda d: _runtime(d)["spec"]["template"]["spec"]["failurePolicy"]["rules"][0].update(
            name="script-bug"
        ),
        "TrainingRuntime",
        "spec.template.spec.failurePolicy.rules[0].name",
        "no '-'",
        False,
    ),
    "reserved_pet_env": (
        lambda d: _trainjob(d)["spec"]["trainer"].update(
            env=[{"name": "PET_NNODES", "value": "4"}]
        ),
        "TrainJob",
        "spec.trainer.env[0]",
        "reserved",
        False,
    ),
    "bad_trainjob_name": (
        lambda d: _trainjob(d)["metadata"].update(name="LLM_Job"),
        "TrainJob",
        "metadata.name",
        "RFC 1035",
        False,
    ),
    "duplicate_replicated_job": (
        lambda d: _runtime(d)["spec"]["template"]["spec"]["replicatedJobs"].append(
            copy.deepcopy(_runtime(d)["spec"]["template"]["spec"]["replicatedJobs"][0])
        ),
        "TrainingRuntime",
        "spec.template.spec.replicatedJobs[1]",
        "duplicate entry (name='node')",
        False,
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_manifests_are_reported_with_the_fields_path(
    crds: dict[str, Doc], case: str
) -> None:
    mutate, kind, path, message, crd_catches = BROKEN[case]
    docs = _rendered()
    mutate(docs)
    report = validate_documents(docs, use_core_schemas=False)
    found = [str(p) for p in report.errors]
    assert any(p.path == path and message in p.message for p in report.errors), found
    assert all(p.obj.startswith(kind) for p in report.errors if p.path == path)
    doc = _trainjob(docs) if kind == "TrainJob" else _runtime(docs)
    assert bool(_crd_errors(crds[kind], doc)) == crd_catches, _crd_errors(crds[kind], doc)
