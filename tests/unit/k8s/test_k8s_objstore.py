"""An object-store checkpoint in the job spec (``spec.checkpoint.url`` +
``storageOptions``): accepted and refused specs, named by field, and what both targets
render (no PVC, the two variables, credentials only by reference)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from k8s_paths import GOLDEN

from flexrun.errors import SpecError
from flexrun.k8s.render import render
from flexrun.k8s.spec import load_job_spec, parse_job_spec
from flexrun.k8s.validate import validate_documents

pytestmark = pytest.mark.timeout(30)

Doc = dict[str, Any]
URL = "s3://ml-checkpoints/job"
OPTIONS = {"endpoint_url": "http://minio:9000", "client_kwargs": {"region_name": "eu-west-1"}}


def _spec(checkpoint: object, **extra: object) -> Doc:
    return {
        "metadata": {"name": "job"},
        "spec": {
            "image": "img:1",
            "script": "train.py",
            "nnodes": "1:3",
            "checkpoint": copy.deepcopy(checkpoint),
            **extra,
        },
    }


def _worker_pods(docs: list[Doc]) -> list[Doc]:
    pods = []
    for d in docs:
        if d["kind"] == "PyTorchJob":
            pods.append(d["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"])
        elif d["kind"] in ("TrainingRuntime", "ClusterTrainingRuntime"):
            (job,) = d["spec"]["template"]["spec"]["replicatedJobs"]
            pods.append(job["template"]["spec"]["template"]["spec"])
    assert pods
    return pods


def _env(pod: Doc) -> dict[str, str]:
    (container,) = pod["containers"]
    return {e["name"]: e.get("value") for e in container["env"]}


def test_a_url_checkpoint_parses_with_its_options() -> None:
    spec = parse_job_spec(_spec({"url": URL, "storageOptions": OPTIONS}))
    assert spec.checkpoint is not None
    assert spec.checkpoint.url == URL and not spec.checkpoint.has_volume
    assert spec.checkpoint.location == URL
    assert spec.checkpoint.storage_options == OPTIONS
    for url in ("gs://b/p", "abfs://container/dir", "simplecache::s3://b/p", "az://c/d"):
        assert parse_job_spec(_spec({"url": url})).checkpoint.location == url  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("checkpoint", "expected"),
    [
        ({"url": "s3://AKIA:secret@bucket/p"}, "spec.checkpoint.url: the URL embeds credentials"),
        ({"url": "https://user:pw@host/ckpt"}, "spec.checkpoint.url: the URL embeds credentials"),
        (
            {"url": "https://acct.blob.core.windows.net/c?sv=1&sig=abc"},
            "spec.checkpoint.url: the URL's query parameter 'sig' is a credential",
        ),
        ({"url": "/checkpoints"}, "spec.checkpoint.url: '/checkpoints' is not an fsspec URL"),
        ({"url": "s3://"}, "spec.checkpoint.url: 's3://' is not an fsspec URL"),
        ({"url": "file:///ckpt"}, "spec.checkpoint.url: file:// lives inside the pod"),
        ({"url": "memory://ckpt"}, "spec.checkpoint.url: memory:// lives inside the pod"),
        ({"url": URL, "size": "1Ti"}, "spec.checkpoint.size: contradicts url"),
        ({"url": URL, "existingClaim": "c"}, "spec.checkpoint.existingClaim: contradicts url"),
        ({"url": URL, "storageClass": "nfs"}, "spec.checkpoint.storageClass: contradicts url"),
        ({"url": URL, "accessMode": "ReadWriteMany"}, "spec.checkpoint.accessMode: contradicts"),
        ({"url": URL, "mountPath": "/ckpt"}, "spec.checkpoint.mountPath: contradicts url"),
        (
            {"url": URL, "storageOptions": {"key": "AKIA", "secret": "x"}},
            "spec.checkpoint.storageOptions.key: looks like a credential",
        ),
        (
            {"url": URL, "storageOptions": {"client_kwargs": {"aws_secret_access_key": "x"}}},
            "spec.checkpoint.storageOptions.client_kwargs.aws_secret_access_key: looks like a",
        ),
        (
            {"url": URL, "storageOptions": {"config_kwargs": {"x": [{"password": "p"}]}}},
            r"spec.checkpoint.storageOptions.config_kwargs.x\[0\].password: looks like",
        ),
        ({"url": URL, "storageOptions": "anon"}, "spec.checkpoint.storageOptions: must be a map"),
        (
            {"url": URL, "storageOptions": {"when": float("nan")}},
            "spec.checkpoint.storageOptions: must hold only JSON values",
        ),
        (
            {"size": "1Ti", "storageOptions": OPTIONS},
            "spec.checkpoint.storageOptions: only with url",
        ),
        ({"url": URL, "bucket": "x"}, "spec.checkpoint.bucket: unknown field"),
    ],
)
def test_bad_url_checkpoints_are_refused_naming_the_field(checkpoint: Doc, expected: str) -> None:
    with pytest.raises(SpecError, match=expected):
        parse_job_spec(_spec(checkpoint))


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({"env": {"FLEXRUN_CHECKPOINT_STORAGE_OPTIONS": "{}"}}, "is set by flexrun k8s render"),
        ({"envFrom": [{"secretRef": {"name": "Bad_Name"}}]}, r"spec.envFrom\[0\].secretRef.name"),
        ({"envFrom": [{"secretRef": {"name": "a"}, "configMapRef": {"name": "b"}}]}, "exactly one"),
        ({"envFrom": [{}]}, r"spec.envFrom\[0\]: set exactly one of secretRef and configMapRef"),
        ({"envFrom": [{"secretRef": {"name": "a", "key": "k"}}]}, "secretRef.key: unknown field"),
        ({"envFrom": [{"secretRef": {"name": "a"}, "prefix": "1X"}]}, r"envFrom\[0\].prefix"),
        ({"env": {"AWS_SECRET_ACCESS_KEY": "x"}}, "spec.env.AWS_SECRET_ACCESS_KEY: a credential"),
        ({"serviceAccountName": "Not Valid"}, "spec.serviceAccountName: 'Not Valid' is not"),
    ],
)
def test_bad_credential_references_are_refused(extra: Doc, expected: str) -> None:
    with pytest.raises(SpecError, match=expected):
        parse_job_spec(_spec({"url": URL}, **extra))


@pytest.mark.parametrize("target", ["pytorchjob", "trainjob"])
def test_both_targets_render_the_url_and_options_and_no_volume(target: str) -> None:
    doc = _spec(
        {"url": URL, "storageOptions": OPTIONS},
        serviceAccountName="train-sa",
        envFrom=[{"secretRef": {"name": "s3-creds"}, "prefix": "AWS_"}],
    )
    docs = render(parse_job_spec(doc, target=target))
    assert "PersistentVolumeClaim" not in [d["kind"] for d in docs]
    for pod in _worker_pods(docs):
        env = _env(pod)
        assert env["FLEXRUN_CHECKPOINT_DIR"] == URL
        raw = env["FLEXRUN_CHECKPOINT_STORAGE_OPTIONS"]
        assert json.loads(raw) == OPTIONS
        assert raw == json.dumps(OPTIONS, sort_keys=True, separators=(",", ":"))
        (container,) = pod["containers"]
        assert container["envFrom"] == [{"secretRef": {"name": "s3-creds"}, "prefix": "AWS_"}]
        assert "checkpoints" not in [m["name"] for m in container["volumeMounts"]]
        assert "checkpoints" not in [v["name"] for v in pod["volumes"]]
        assert pod["serviceAccountName"] == "train-sa"
    report = validate_documents(docs)
    assert report.problems == (), [str(p) for p in report.problems]


def test_a_url_without_options_sets_only_the_dir() -> None:
    (pod,) = _worker_pods(render(parse_job_spec(_spec({"url": URL}))))
    env = _env(pod)
    assert env["FLEXRUN_CHECKPOINT_DIR"] == URL
    assert "FLEXRUN_CHECKPOINT_STORAGE_OPTIONS" not in env
    assert "serviceAccountName" not in pod


def test_a_volume_checkpoint_is_unchanged_by_the_new_fields() -> None:
    docs = render(load_job_spec(GOLDEN / "tcp.job.yaml"))
    assert "PersistentVolumeClaim" in [d["kind"] for d in docs]
    (pod,) = _worker_pods(docs)
    assert _env(pod)["FLEXRUN_CHECKPOINT_DIR"] == "/ckpt"
    assert "FLEXRUN_CHECKPOINT_STORAGE_OPTIONS" not in _env(pod)


def test_no_rendered_golden_carries_a_credential() -> None:
    for name in ("objstore.yaml", "trainjob-objstore.yaml"):
        text = (GOLDEN / name).read_text(encoding="utf-8")
        assert "AWS_SECRET_ACCESS_KEY" not in text and "secret_access_key" not in text
        assert "s3://ml-checkpoints/resnet-s3" in text
