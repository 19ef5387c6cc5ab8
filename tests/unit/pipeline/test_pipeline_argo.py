"""Argo rendering: schema-valid Workflow, the train stage as a PyTorchJob resource step."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from flexrun.errors import SpecError
from flexrun.pipeline.argo import (
    SUCCESS_CONDITION,
    embedded_manifests,
    render_workflow,
    to_yaml,
)
from flexrun.pipeline.spec import load_pipeline, parse_pipeline

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples" / "pipeline" / "pipeline.yaml"
ARGO_SCHEMA = REPO / ".." / "shared" / "schemas" / "argo-workflows.schema.json"

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def workflow() -> dict[str, Any]:
    # Through YAML and back: what `flexrun pipeline render` prints is what is checked.
    return yaml.safe_load(to_yaml(render_workflow(load_pipeline(EXAMPLE))))


def test_rendered_workflow_validates_against_the_argo_schema(workflow: dict[str, Any]) -> None:
    if not ARGO_SCHEMA.is_file():
        pytest.skip(f"{ARGO_SCHEMA} absent (a checkout without ../shared/schemas)")
    import jsonschema

    schema = json.loads(ARGO_SCHEMA.read_text())
    validator = jsonschema.validators.validator_for(schema)(schema)
    errors = sorted(validator.iter_errors(workflow), key=lambda e: list(e.absolute_path))
    assert not errors, [e.message[:300] for e in errors]
    # The oneOf above also matches WorkflowTemplate's shape; pin the Workflow definition.
    pinned = {"$ref": "#/definitions/io.argoproj.workflow.v1alpha1.Workflow", **schema}
    pinned.pop("oneOf")
    sub_errors = list(jsonschema.validators.validator_for(schema)(pinned).iter_errors(workflow))
    assert not sub_errors, [e.message[:300] for e in sub_errors]


def test_embedded_pytorchjob_passes_flexrun_k8s_validate(workflow: dict[str, Any]) -> None:
    from flexrun.k8s.validate import validate_documents

    docs = embedded_manifests(workflow)
    kinds = [d["kind"] for d in docs]
    assert "PyTorchJob" in kinds
    report = validate_documents(docs)
    assert report.ok, [str(p) for p in report.problems]


def test_embedded_pytorchjob_passes_the_cli_validate(
    workflow: dict[str, Any], tmp_path: Path
) -> None:
    from flexrun.cli import main

    job = next(d for d in embedded_manifests(workflow) if d["kind"] == "PyTorchJob")
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    assert main(["k8s", "validate", "-q", str(path)]) == 0


def test_stages_map_to_container_steps_and_train_to_a_resource_step(
    workflow: dict[str, Any],
) -> None:
    spec = workflow["spec"]
    assert workflow["apiVersion"] == "argoproj.io/v1alpha1" and workflow["kind"] == "Workflow"
    templates = {t["name"]: t for t in spec["templates"]}
    tasks = {t["name"]: t for t in templates["main"]["dag"]["tasks"]}
    for name in ("preprocess", "evaluate", "export"):
        c = templates[name]["container"]
        assert c["workingDir"] == "/work"
        assert c["volumeMounts"] == [{"name": "artifacts", "mountPath": "/work"}]
        assert c["command"] == ["python"] and c["args"][0].startswith("/app/examples/pipeline/")
    train = templates["train"]["resource"]
    assert train["action"] == "create" and train["setOwnerReference"] is True
    assert train["successCondition"] == SUCCESS_CONDITION
    assert "failureCondition" not in train  # (why: flexrun.pipeline.argo's docstring)
    assert "train" in tasks["evaluate"]["dependencies"]
    assert {"preprocess", "train-deployment", "train-service"} <= set(
        tasks["train"]["dependencies"]
    )
    assert spec["volumes"] == [
        {"name": "artifacts", "persistentVolumeClaim": {"claimName": "digits-artifacts"}}
    ]
    job = next(d for d in embedded_manifests(workflow) if d["kind"] == "PyTorchJob")
    pod = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == "digits-artifacts"
    assert job["spec"]["elasticPolicy"]["minReplicas"] == 1
    assert job["spec"]["elasticPolicy"]["maxReplicas"] == 4
    assert pod["containers"][0]["workingDir"] == "/work"


def _mini(**train: Any) -> Any:
    return parse_pipeline(
        {
            "name": "mini",
            "argo": {"image": "img:1"},
            "stages": [{"name": "train", "train": {"script": "t.py", **train}}],
        },
        base_dir=Path("/tmp"),
    )


def test_train_fields_owned_by_the_pipeline_cannot_be_overridden() -> None:
    with pytest.raises(SpecError, match=r"stages\.train\.train\.k8s\.checkpoint"):
        render_workflow(_mini(k8s={"checkpoint": {"size": "1Gi"}}))


def test_invalid_train_job_is_a_spec_error_naming_the_stage() -> None:
    with pytest.raises(
        SpecError, match=r"stages\.train\.train: as a Kubernetes job: .*gracePeriod"
    ):
        render_workflow(_mini(k8s={"gracePeriodSeconds": 1}))


def test_missing_image_is_a_spec_error() -> None:
    p = parse_pipeline(
        {"name": "x", "stages": [{"name": "a", "command": "echo"}]}, base_dir=Path("/tmp")
    )
    with pytest.raises(SpecError, match="argo.image is required"):
        render_workflow(p)


def test_retries_etcd_store_and_gpus_render_valid_objects() -> None:
    p = parse_pipeline(
        {
            "name": "x",
            "argo": {"image": "i:1", "namespace": "ml", "serviceAccountName": "wf"},
            "stages": [
                {"name": "a", "command": "echo hi", "retries": 2, "timeout": 10, "outputs": ["o"]},
                {
                    "name": "t",
                    "inputs": ["o"],
                    "train": {
                        "script": "{pipeline_dir}/t.py",
                        "nnodes": "2:3",
                        "nprocPerNode": "gpu",
                        "k8s": {"resources": {"gpu": 8}, "store": {"type": "etcd"}},
                    },
                },
                {"name": "b", "command": ["echo"], "deps": ["t"]},
            ],
        },
        base_dir=Path("/tmp"),
    )
    wf = yaml.safe_load(to_yaml(render_workflow(p)))
    templates = {t["name"]: t for t in wf["spec"]["templates"]}
    assert templates["a"]["retryStrategy"] == {"limit": "2", "retryPolicy": "OnFailure"}
    tasks = {t["name"]: t for t in templates["main"]["dag"]["tasks"]}
    assert tasks["b"]["dependencies"] == ["t"]
    assert {"t-statefulset", "t-service", "t-service-2"} <= set(tasks["t"]["dependencies"])
    from flexrun.k8s.validate import validate_documents

    report = validate_documents(embedded_manifests(wf))
    assert report.ok, [str(x) for x in report.problems]
    if ARGO_SCHEMA.is_file():
        import jsonschema

        schema = json.loads(ARGO_SCHEMA.read_text())
        errors = list(jsonschema.validators.validator_for(schema)(schema).iter_errors(wf))
        assert not errors, [e.message[:300] for e in errors]


def test_secret_env_values_never_reach_the_workflow_only_secret_references() -> None:
    secrets = {
        "FLEXRUN_JOB_SECRET": "job-secret-value-0123456789abcdef0123",
        "AWS_SECRET_ACCESS_KEY": "aws-secret-value",
        "FLEXRUN_ETCD_PASSWORD": "etcd-pw-value",
        "MY_API_TOKEN": "token-value",
    }
    p = parse_pipeline(
        {
            "name": "x",
            "argo": {"image": "i:1"},
            "env": {"FLEXRUN_JOB_SECRET": secrets["FLEXRUN_JOB_SECRET"], "PLAIN": "ok"},
            "stages": [
                {
                    "name": "a",
                    "command": "echo hi",
                    "env": {k: v for k, v in secrets.items() if k != "FLEXRUN_JOB_SECRET"},
                }
            ],
        },
        base_dir=Path("/tmp"),
    )
    text = to_yaml(render_workflow(p))
    for value in secrets.values():
        assert value not in text
    wf = yaml.safe_load(text)
    (tmpl,) = [t for t in wf["spec"]["templates"] if t["name"] == "a"]
    env = {e["name"]: e for e in tmpl["container"]["env"]}
    assert env["PLAIN"] == {"name": "PLAIN", "value": "ok"}
    for name in secrets:
        assert env[name] == {
            "name": name,
            "valueFrom": {"secretKeyRef": {"name": "x-env", "key": name}},
        }
