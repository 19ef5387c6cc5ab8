"""The rendered Workflow's DAG, for both train targets (PyTorchJob and TrainJob): every task
runs a template that exists, every dependency is a task, the graph has no cycle, later
stages wait for the train step, and the train step's success/failure conditions are ones
Argo can parse, on status fields the job's CRD has, and reach the right verdict on the
statuses the operator writes (Argo's semantics: ``argo_conditions.py``)."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from argo_conditions import outcome, parse, schema_has_path

from flexrun.pipeline.argo import JOB_CONDITIONS, embedded_manifests, render_workflow, to_yaml
from flexrun.pipeline.spec import parse_pipeline

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples" / "pipeline" / "pipeline.yaml"
SHARED = Path(os.environ.get("FLEXRUN_SHARED_SCHEMAS") or REPO.parent / "shared" / "schemas")
ARGO_SCHEMA = SHARED / "argo-workflows.schema.json"
PYTORCHJOB_CRD = SHARED / "kubeflow.org_pytorchjobs.yaml"
TRAINER_SCHEMA = REPO / "src" / "flexrun" / "k8s" / "schemas" / "trainer-v2.3.0.json"

pytestmark = pytest.mark.timeout(120)
TARGETS = ("pytorchjob", "trainjob")
JOB_KIND = {"pytorchjob": "PyTorchJob", "trainjob": "TrainJob"}


def _workflow(target: str, url_checkpoint: bool = False) -> dict[str, Any]:
    data = yaml.safe_load(EXAMPLE.read_text())
    data = copy.deepcopy(data)
    train = next(s for s in data["stages"] if s["name"] == "train")["train"]
    train["k8s"]["target"] = target
    if url_checkpoint:
        del train["checkpointDir"]
        train["checkpointUrl"] = "s3://bucket/ckpt"
    pipeline = parse_pipeline(data, base_dir=EXAMPLE.parent, source=str(EXAMPLE))
    # Through YAML and back: what `flexrun pipeline render` prints is what is checked.
    return yaml.safe_load(to_yaml(render_workflow(pipeline)))


@pytest.fixture(scope="module", params=TARGETS)
def rendered(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    return request.param, _workflow(request.param)


def _dag(workflow: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    templates = {t["name"]: t for t in workflow["spec"]["templates"]}
    entry = templates[workflow["spec"]["entrypoint"]]
    return templates, {t["name"]: t for t in entry["dag"]["tasks"]}


def test_every_task_has_a_template_every_dependency_a_task_and_no_cycle(
    rendered: tuple[str, dict[str, Any]],
) -> None:
    _, workflow = rendered
    templates, tasks = _dag(workflow)
    assert len(tasks) == len(workflow["spec"]["templates"][0]["dag"]["tasks"]), "duplicate task"
    for name, task in tasks.items():
        assert task["template"] in templates, f"task {name}: no template {task['template']}"
        missing = set(task.get("dependencies", [])) - set(tasks)
        assert not missing, f"task {name} depends on tasks that do not exist: {missing}"
    done: set[str] = set()
    for _ in range(len(tasks)):  # Kahn: every round some task has all of its deps done
        ready = {
            n for n, t in tasks.items() if n not in done and set(t.get("dependencies", [])) <= done
        }
        done |= ready
    assert done == set(tasks), f"a cycle among {set(tasks) - done}"


def test_later_stages_wait_for_the_train_step_which_creates_the_targets_job(
    rendered: tuple[str, dict[str, Any]],
) -> None:
    target, workflow = rendered
    templates, tasks = _dag(workflow)
    assert "train" in tasks and "train" in tasks["evaluate"]["dependencies"]
    resource = templates[tasks["train"]["template"]]["resource"]
    (job,) = yaml.safe_load_all(resource["manifest"])
    assert job["kind"] == JOB_KIND[target] and resource["action"] == "create"
    # the train step comes after every object it needs (store, runtime) and the inputs
    others = {
        n
        for n, t in tasks.items()
        if n.startswith("train-") and "resource" in templates[t["template"]]
    }
    assert others and others | {"preprocess"} <= set(tasks["train"]["dependencies"])
    kinds = {d["kind"] for d in embedded_manifests(workflow)}
    if target == "trainjob":
        assert {"TrainingRuntime", "TrainJob"} <= kinds and "PyTorchJob" not in kinds
        runtime = next(d for d in embedded_manifests(workflow) if d["kind"] == "TrainingRuntime")
        rjob = runtime["spec"]["template"]["spec"]["replicatedJobs"]
        assert len(rjob) == 1, "the conditions read jobsStatus.0: one replicated job"
        pod = rjob[0]["template"]["spec"]["template"]["spec"]
        assert pod["containers"][0]["workingDir"] == "/work"
    else:
        assert "PyTorchJob" in kinds and "TrainJob" not in kinds


def _status_schema(kind: str) -> dict[str, Any]:
    if kind == "TrainJob":
        return json.loads(TRAINER_SCHEMA.read_text())["schemas"]["TrainJob"]["properties"]["status"]
    if not PYTORCHJOB_CRD.is_file():
        pytest.skip(f"{PYTORCHJOB_CRD} absent (a checkout without ../shared/schemas)")
    crd = yaml.safe_load(PYTORCHJOB_CRD.read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]


def test_conditions_parse_as_argo_does_and_name_real_status_fields(
    rendered: tuple[str, dict[str, Any]],
) -> None:
    target, workflow = rendered
    templates, tasks = _dag(workflow)
    resource = templates[tasks["train"]["template"]]["resource"]
    kind = JOB_KIND[target]
    assert resource["successCondition"] == JOB_CONDITIONS[kind][0]
    assert resource.get("failureCondition") == JOB_CONDITIONS[kind][1]
    status = _status_schema(kind)
    for cond in (resource["successCondition"], resource.get("failureCondition")):
        if cond is None:
            continue
        reqs = parse(cond)
        # Argo fails the step when ANY failure requirement holds: one requirement only
        assert cond == resource["successCondition"] or len(reqs) == 1
        for key, _, _ in reqs:
            assert key.startswith("status."), key
            assert schema_has_path(status, key.removeprefix("status.")), f"{kind} has no {key}"


def _job(n: int, **counts: int) -> dict[str, Any]:
    return {
        "name": "node",
        "active": n,
        "ready": 0,
        "suspended": 0,
        "succeeded": 0,
        "failed": 0,
        **counts,
    }


# (status as the operator writes it, Argo's verdict)
STATUSES: dict[str, list[tuple[dict[str, Any], str]]] = {
    "PyTorchJob": [
        ({}, "waiting"),  # just created
        ({"replicaStatuses": {"Worker": {"active": 4}}}, "waiting"),
        # a preempted Worker (exit 143) about to be recreated: not a failure
        ({"replicaStatuses": {"Worker": {"active": 3, "failed": 1}}}, "waiting"),
        (
            {
                "replicaStatuses": {"Worker": {"succeeded": 1, "active": 3}},
                "completionTime": "2026-12-04T00:00:00Z",
            },
            "succeeded",
        ),
    ],
    "TrainJob": [
        ({}, "waiting"),
        ({"jobsStatus": [_job(1)]}, "waiting"),
        ({"jobsStatus": [_job(0, succeeded=1)]}, "succeeded"),
        ({"jobsStatus": [_job(0, failed=1)]}, "failed"),
    ],
}


@pytest.mark.parametrize("kind", sorted(STATUSES))
def test_conditions_reach_the_right_verdict_on_the_operators_statuses(kind: str) -> None:
    success, failure = JOB_CONDITIONS[kind]
    for status, want in STATUSES[kind]:
        assert outcome(success, failure, {"status": status}) == want, (status, want)


def test_the_condition_grammar_refuses_what_argo_cannot_parse() -> None:
    with pytest.raises(ValueError):
        parse('status.conditions.#(type=="Complete").status == True')
    with pytest.raises(ValueError, match="qualified name"):
        parse("status.conditions.#.type = Complete")
    with pytest.raises(ValueError):
        parse("status.x > one")
    # Argo ORs failure requirements: this is what the old PyTorchJob failure condition did
    # (failed at once, before any Worker existed)
    assert (
        outcome(
            None, "status.completionTime,!status.replicaStatuses.Worker.succeeded", {"status": {}}
        )
        == "failed"
    )


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("url", [False, True])
def test_rendered_workflow_validates_against_the_argo_schema(target: str, url: bool) -> None:
    if not ARGO_SCHEMA.is_file():
        pytest.skip(f"{ARGO_SCHEMA} absent (a checkout without ../shared/schemas)")
    import jsonschema

    workflow = _workflow(target, url_checkpoint=url)
    schema = json.loads(ARGO_SCHEMA.read_text())
    pinned = {"$ref": "#/definitions/io.argoproj.workflow.v1alpha1.Workflow", **schema}
    pinned.pop("oneOf")
    errors = list(jsonschema.validators.validator_for(schema)(pinned).iter_errors(workflow))
    assert not errors, [e.message[:300] for e in errors]


@pytest.mark.parametrize("url", [False, True])
def test_embedded_trainjob_objects_pass_flexrun_k8s_validate(url: bool) -> None:
    from flexrun.k8s.validate import validate_documents

    docs = embedded_manifests(_workflow("trainjob", url_checkpoint=url))
    report = validate_documents(docs)
    assert report.ok, [str(p) for p in report.problems]


def test_a_cluster_training_runtime_gets_no_owner_reference_to_the_namespaced_workflow() -> None:
    data = yaml.safe_load(EXAMPLE.read_text())
    train = next(s for s in data["stages"] if s["name"] == "train")["train"]
    train["k8s"].update(target="trainjob", trainJob={"runtimeKind": "ClusterTrainingRuntime"})
    workflow = render_workflow(parse_pipeline(data, base_dir=EXAMPLE.parent))
    templates, tasks = _dag(workflow)
    owner = {
        next(yaml.safe_load_all(t["resource"]["manifest"]))["kind"]: t["resource"][
            "setOwnerReference"
        ]
        for t in templates.values()
        if "resource" in t
    }
    assert owner.pop("ClusterTrainingRuntime") is False
    assert owner and all(owner.values()), owner
    assert "train-clustertrainingruntime" in tasks["train"]["dependencies"]


@pytest.mark.parametrize("target", TARGETS)
def test_a_train_stage_with_scheduling_network_and_run_dir_renders_a_valid_workflow(
    target: str,
) -> None:
    from flexrun.k8s.validate import validate_documents

    data = yaml.safe_load(EXAMPLE.read_text())
    train = next(s for s in data["stages"] if s["name"] == "train")["train"]
    train["k8s"].update(
        target=target,
        scheduling={
            "priorityClassName": "high",
            "onePodPerNode": True,
            "kueue": {"queueName": "q"},
        },
        network={"hostNetwork": True, "rdma": {"resource": "rdma/hca"}},
        runDir={"checkpointVolume": True},
    )
    workflow = yaml.safe_load(
        to_yaml(render_workflow(parse_pipeline(data, base_dir=EXAMPLE.parent)))
    )
    docs = embedded_manifests(workflow)
    job = next(d for d in docs if d["kind"] == JOB_KIND[target])
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "q"
    report = validate_documents(docs, use_core_schemas=False)
    assert report.ok, [str(p) for p in report.errors]
    if ARGO_SCHEMA.is_file():
        import jsonschema

        schema = json.loads(ARGO_SCHEMA.read_text())
        pinned = {"$ref": "#/definitions/io.argoproj.workflow.v1alpha1.Workflow", **schema}
        pinned.pop("oneOf")
        errors = list(jsonschema.validators.validator_for(schema)(pinned).iter_errors(workflow))
        assert not errors, [e.message[:300] for e in errors]
