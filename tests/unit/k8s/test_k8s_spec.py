"""The job spec: defaults, and one clear error naming the field for every bad input."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
from k8s_paths import EXAMPLE

from flexrun.errors import ConfigError, SpecError
from flexrun.k8s.spec import load_job_spec, parse_job_spec

pytestmark = pytest.mark.timeout(30)

MINIMAL: dict[str, Any] = {
    "metadata": {"name": "job"},
    "spec": {"image": "img:1", "script": "train.py", "nnodes": "1:3"},
}


def _with(path: str, value: object) -> dict[str, Any]:
    doc = copy.deepcopy(MINIMAL)
    node = doc
    *parents, leaf = path.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = value
    return doc


def test_minimal_spec_gets_defaults() -> None:
    spec = parse_job_spec(MINIMAL)
    assert (spec.nnodes.min, spec.nnodes.max) == (1, 3)
    assert spec.replicas == 3
    assert spec.nproc_per_node == "auto"
    assert spec.store.type == "tcp" and spec.store.port == 29400
    assert spec.rdzv_backend == "c10d"
    assert spec.grace_period_s == 120
    assert spec.checkpoint is None


def test_example_spec_parses() -> None:
    spec = load_job_spec(EXAMPLE)
    assert spec.name == "resnet50"
    assert spec.nproc_per_node == "8" and spec.resources.gpu == 8


def test_fixed_size_and_gpu_default_nproc() -> None:
    spec = parse_job_spec(_with("spec.nnodes", 2) | {})
    assert (spec.nnodes.min, spec.nnodes.max) == (2, 2)
    spec = parse_job_spec(_with("spec.resources", {"gpu": 4}))
    assert spec.nproc_per_node == "4"


def test_etcd_store_selects_etcd_v3_backend() -> None:
    assert parse_job_spec(_with("spec.store", {"type": "etcd"})).rdzv_backend == "etcd-v3"


@pytest.mark.parametrize(
    ("path", "value", "expected"),
    [
        ("spec.nnodes", "4:2", "spec.nnodes: min 4 > max 2"),
        ("spec.nnodes", "0:2", "spec.nnodes: min must be >= 1"),
        ("spec.nnodes", "a:b", "spec.nnodes: must be N or MIN:MAX"),
        ("spec.replicas", 5, "spec.replicas: 5 outside nnodes 1:3"),
        ("spec.nprocPerNode", "many", "spec.nprocPerNode:"),
        ("spec.nprocPerNode", "gpu", "spec.nprocPerNode: gpu needs spec.resources.gpu"),
        ("spec.store", {"type": "zookeeper"}, "spec.store.type: 'zookeeper' not one of tcp, etcd"),
        ("spec.gracePeriodSeconds", 5, "spec.gracePeriodSeconds: 5 leaves no time"),
        ("spec.maxRestarts", -1, "spec.maxRestarts: must be >= 0"),
        (
            "spec.env",
            {"PET_NNODES": "1:2"},
            "spec.env.PET_NNODES: is injected by the Kubeflow operator",
        ),
        (
            "spec.resources",
            {"memory": "lots"},
            "spec.resources.memory: 'lots' is not a Kubernetes quantity",
        ),
        ("spec.checkpoint", {"mountPath": "/c"}, "spec.checkpoint: set size"),
        (
            "spec.checkpoint",
            {"size": "1Ti", "accessMode": "ReadWriteOnce"},
            "spec.checkpoint.accessMode:",
        ),
        (
            "spec.spot",
            {"tolerations": [{"key": "k", "operator": "Maybe"}]},
            "spec.spot.tolerations[0].operator:",
        ),
        ("spec.hpa", {"metrics": [{"type": "Cpu"}]}, "spec.hpa.metrics[0].type:"),
        ("spec.imagee", "x", "spec.imagee: unknown field"),
        ("metadata.name", "Bad_Name", "metadata.name: 'Bad_Name' must be a DNS-1035 label"),
        ("spec.module", "pkg.train", "spec.script: set exactly one of script and module"),
    ],
)
def test_bad_spec_is_rejected_naming_the_field(path: str, value: object, expected: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_job_spec(_with(path, value))
    assert str(info.value).startswith(expected), str(info.value)
    assert "\n" not in str(info.value)


def test_spec_error_is_a_config_error_so_the_cli_exits_2() -> None:
    assert issubclass(SpecError, ConfigError)


def test_missing_image_is_named() -> None:
    doc = copy.deepcopy(MINIMAL)
    del doc["spec"]["image"]
    with pytest.raises(SpecError, match=r"^spec\.image: is required"):
        parse_job_spec(doc)


def test_unreadable_and_non_yaml_files_raise_spec_error(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="cannot read"):
        load_job_spec(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("spec: [unclosed\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_job_spec(bad)


def test_file_errors_name_file_and_field(tmp_path: Path) -> None:
    f = tmp_path / "job.yaml"
    f.write_text('metadata: {name: x}\nspec: {image: i, script: t.py, nnodes: "4:2"}\n')
    with pytest.raises(SpecError, match=r"job\.yaml: spec\.nnodes: min 4 > max 2$"):
        load_job_spec(f)
