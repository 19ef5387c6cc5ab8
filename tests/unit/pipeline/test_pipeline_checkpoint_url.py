"""A train stage's object-store checkpoint (``train.checkpointUrl`` + ``storageOptions``):
validation naming the field, the two variables the stage gets, and the Argo form (the
job's ``checkpoint.url``, no checkpoint claim, the artifacts claim still mounted)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from flexrun.errors import SpecError
from flexrun.pipeline.argo import embedded_manifests, render_workflow, to_yaml
from flexrun.pipeline.runner import Runner, RunOptions, checkpoint_env
from flexrun.pipeline.spec import parse_pipeline

pytestmark = pytest.mark.timeout(60)

URL = "s3://ml-checkpoints/digits"
OPTIONS = {"endpoint_url": "http://minio:9000", "client_kwargs": {"region_name": "eu-west-1"}}


def _pipeline(env: dict[str, str] | None = None, **train: Any) -> Any:
    stage: dict[str, Any] = {"name": "fit", "train": {"script": "t.py", **train}}
    if env is not None:
        stage["env"] = env
    return parse_pipeline(
        {"name": "mini", "argo": {"image": "img:1"}, "stages": [stage]}, base_dir=Path("/tmp")
    )


def test_a_checkpoint_url_and_options_parse() -> None:
    train = _pipeline(checkpointUrl=URL, storageOptions=OPTIONS).stages[0].train
    assert train.checkpoint_url == URL and train.checkpoint_dir is None
    assert train.storage_options == OPTIONS


@pytest.mark.parametrize(
    ("train", "expected"),
    [
        (
            {"checkpointUrl": URL, "checkpointDir": "ckpt"},
            r"stages\.fit\.train\.checkpointUrl: set checkpointDir or checkpointUrl, not both",
        ),
        (
            {"checkpointDir": "ckpt", "storageOptions": OPTIONS},
            r"stages\.fit\.train\.storageOptions: only with checkpointUrl",
        ),
        (
            {"checkpointUrl": "s3://key:secret@bucket/p"},
            r"stages\.fit\.train\.checkpointUrl: the URL embeds credentials",
        ),
        ({"checkpointUrl": "ckpt"}, r"stages\.fit\.train\.checkpointUrl: 'ckpt' is not an fsspec"),
        (
            {"checkpointUrl": URL, "storageOptions": {"secret": "x"}},
            r"stages\.fit\.train\.storageOptions\.secret: looks like a credential",
        ),
        (
            {"checkpointUrl": URL, "storageOptions": {"client_kwargs": {"aws_session_token": "t"}}},
            r"stages\.fit\.train\.storageOptions\.client_kwargs\.aws_session_token: looks like",
        ),
        (
            {"checkpointUrl": URL, "storageOptions": ["anon"]},
            r"stages\.fit\.train\.storageOptions: must be a mapping",
        ),
    ],
)
def test_bad_checkpoint_urls_are_refused_naming_the_field(
    train: dict[str, Any], expected: str
) -> None:
    with pytest.raises(SpecError, match=expected):
        _pipeline(**train)


def test_the_stage_env_may_not_set_what_the_url_sets() -> None:
    with pytest.raises(SpecError, match=r"stages\.fit\.env\.FLEXRUN_CHECKPOINT_DIR: is set from"):
        _pipeline(env={"FLEXRUN_CHECKPOINT_DIR": "/x"}, checkpointUrl=URL)


def test_the_stage_gets_the_url_and_the_options_as_compact_sorted_json(tmp_path: Path) -> None:
    pipeline = _pipeline(env={"A": "1"}, checkpointUrl=URL, storageOptions=OPTIONS)
    train = pipeline.stages[0].train
    env = checkpoint_env(train)
    assert env == {
        "FLEXRUN_CHECKPOINT_DIR": URL,
        "FLEXRUN_CHECKPOINT_STORAGE_OPTIONS": json.dumps(
            OPTIONS, sort_keys=True, separators=(",", ":")
        ),
    }
    assert checkpoint_env(_pipeline(checkpointUrl=URL).stages[0].train) == {
        "FLEXRUN_CHECKPOINT_DIR": URL
    }
    assert checkpoint_env(_pipeline(checkpointDir="ckpt").stages[0].train) == {}
    # The runner layers them on the stage's environment (and so into its cache key).
    runner = Runner(pipeline, RunOptions(run_dir=tmp_path), environ={}, out=io.StringIO())
    assert runner._env(pipeline.stages[0]) == {"A": "1", **env}


def test_argo_renders_a_url_checkpoint_without_a_checkpoint_claim() -> None:
    workflow = yaml.safe_load(
        to_yaml(render_workflow(_pipeline(checkpointUrl=URL, storageOptions=OPTIONS)))
    )
    docs = embedded_manifests(workflow)
    (job,) = [d for d in docs if d["kind"] == "PyTorchJob"]
    pod = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["FLEXRUN_CHECKPOINT_DIR"] == URL
    assert json.loads(env["FLEXRUN_CHECKPOINT_STORAGE_OPTIONS"]) == OPTIONS
    assert [v["name"] for v in pod["volumes"] if "persistentVolumeClaim" in v] == ["artifacts"]
    assert {"name": "artifacts", "mountPath": "/work"} in container["volumeMounts"]
    assert "checkpoints" not in [m["name"] for m in container["volumeMounts"]]
    assert container["workingDir"] == "/work"
    from flexrun.k8s.validate import validate_documents

    report = validate_documents(docs)
    assert report.ok, [str(p) for p in report.problems]


def test_argo_keeps_the_claim_checkpoint_without_a_url() -> None:
    docs = embedded_manifests(render_workflow(_pipeline(checkpointDir="ckpt")))
    (job,) = [d for d in docs if d["kind"] == "PyTorchJob"]
    pod = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    claims = [
        v["persistentVolumeClaim"]["claimName"]
        for v in pod["volumes"]
        if "persistentVolumeClaim" in v
    ]
    assert claims == ["mini-artifacts"]
    (container,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["FLEXRUN_CHECKPOINT_DIR"] == "/work"
    assert "FLEXRUN_CHECKPOINT_STORAGE_OPTIONS" not in env
