"""``spec.runDir``: each pod's run directory on a volume that outlives the pod, rendered
for both targets (``PET_RUN_DIR`` = ``<mount>/<job>/$(POD_NAME)``), valid manifests, and
one clear error for each contradiction."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import yaml
from k8s_paths import EXAMPLE

from flexrun.errors import SpecError
from flexrun.k8s.render import render
from flexrun.k8s.spec import parse_job_spec
from flexrun.k8s.validate import validate_documents

pytestmark = pytest.mark.timeout(120)
HAS_KV = importlib.util.find_spec("kubernetes_validate") is not None


def _doc(target: str = "pytorchjob", **spec: Any) -> dict[str, Any]:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"].update(target=target, **spec)
    return doc


def _pod(docs: list[dict[str, Any]]) -> dict[str, Any]:
    kinds = {d["kind"]: d for d in docs}
    if "PyTorchJob" in kinds:
        return kinds["PyTorchJob"]["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    rjob = kinds["TrainingRuntime"]["spec"]["template"]["spec"]["replicatedJobs"][0]
    return rjob["template"]["spec"]["template"]["spec"]


@pytest.mark.parametrize("target", ["pytorchjob", "trainjob"])
def test_a_run_dir_claim_is_mounted_and_pet_run_dir_names_the_pod(target: str) -> None:
    docs = render(
        parse_job_spec(_doc(target, runDir={"existingClaim": "runs", "mountPath": "/runs"}))
    )
    pod = _pod(docs)
    c = pod["containers"][0]
    names = [e["name"] for e in c["env"]]
    # POD_NAME first: Kubernetes expands $(POD_NAME) only from variables defined before
    assert names.index("POD_NAME") < names.index("PET_RUN_DIR")
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["PET_RUN_DIR"]["value"] == "/runs/resnet50/$(POD_NAME)"
    assert {"name": "runs", "mountPath": "/runs"} in c["volumeMounts"]
    assert {"name": "runs", "persistentVolumeClaim": {"claimName": "runs"}} in pod["volumes"]
    report = validate_documents(docs, use_core_schemas=HAS_KV)
    assert report.problems == (), [str(p) for p in report.problems]


def test_run_dirs_under_the_checkpoint_volume() -> None:
    pod = _pod(render(parse_job_spec(_doc(runDir={"checkpointVolume": True}))))
    c = pod["containers"][0]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["PET_RUN_DIR"] == "/checkpoints/runs/resnet50/$(POD_NAME)"
    assert not any(v["name"] == "runs" for v in pod["volumes"])


def test_without_run_dir_nothing_is_added() -> None:
    c = _pod(render(parse_job_spec(_doc())))["containers"][0]
    assert not {"POD_NAME", "PET_RUN_DIR"} & {e["name"] for e in c["env"]}


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ({"runDir": {}}, r"spec\.runDir: set existingClaim .* or checkpointVolume"),
        ({"runDir": {"existingClaim": "r", "checkpointVolume": True}}, r"spec\.runDir: set existingClaim"),
        ({"runDir": {"existingClaim": "Bad_Claim"}}, r"spec\.runDir\.existingClaim"),
        ({"runDir": {"existingClaim": "r", "mountPath": "runs"}}, r"spec\.runDir\.mountPath: must be an absolute"),
        ({"runDir": {"existingClaim": "r", "mountPath": "/checkpoints"}}, r"spec\.runDir\.mountPath: is the checkpoint"),
        ({"runDir": {"checkpointVolume": True, "mountPath": "/x"}}, r"spec\.runDir\.mountPath: only with existingClaim"),
        ({"runDir": {"existingClaim": "r"}, "env": {"PET_RUN_DIR": "/x"}}, r"spec\.env: PET_RUN_DIR/POD_NAME"),
        ({"runDir": {"checkpointVolume": True}, "checkpoint": {"url": "s3://b/c"}}, r"spec\.runDir\.checkpointVolume: needs a checkpoint PVC"),
    ],
)  # fmt: skip
def test_bad_run_dir_is_one_error_naming_the_field(spec: dict[str, Any], match: str) -> None:
    with pytest.raises(SpecError, match=match) as info:
        parse_job_spec(_doc(**spec))
    assert "\n" not in str(info.value)
