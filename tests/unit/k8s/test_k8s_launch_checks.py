"""``flexrun k8s validate`` catches what people get wrong in a job's pods: ``--nnodes``
against the pods, ``$VAR`` Kubernetes will not expand, spot grace, ``/dev/shm``, GPUs per
process; each message says the fix. flexrun's own renders raise none of the errors."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from k8s_paths import EXAMPLE, TRAINJOB_EXAMPLE

from flexrun.k8s.commands import main
from flexrun.k8s.launch_checks import launcher_options
from flexrun.k8s.render import render
from flexrun.k8s.spec import load_job_spec
from flexrun.k8s.validate import validate_documents

pytestmark = pytest.mark.timeout(60)

# A PyTorchJob as the source documents write it: one Master and three Workers (four pods),
# torchrun told --nnodes=2, and the node rank passed as a literal $RANK.
SOURCE_DOC = """
apiVersion: kubeflow.org/v1
kind: PyTorchJob
metadata: {name: pytorch-ddp, namespace: kubeflow}
spec:
  pytorchReplicaSpecs:
    Master:
      replicas: 1
      restartPolicy: OnFailure
      template:
        spec:
          containers:
            - name: pytorch
              image: docker.io/kubeflow/pytorch-dist-mnist:latest
              command: [torchrun, --nnodes=2, --nproc_per_node=1, --node_rank=$RANK,
                        --master_addr=$MASTER_ADDR, /opt/mnist/src/mnist.py]
    Worker:
      replicas: 3
      restartPolicy: OnFailure
      template:
        spec:
          containers:
            - name: pytorch
              image: docker.io/kubeflow/pytorch-dist-mnist:latest
              command: [torchrun, --nnodes=2, --nproc_per_node=1, --node_rank=$RANK,
                        --master_addr=$MASTER_ADDR, /opt/mnist/src/mnist.py]
"""


def _doc() -> dict[str, Any]:
    return yaml.safe_load(SOURCE_DOC)


def _messages(docs: list[Any]) -> list[str]:
    return [str(p) for p in validate_documents(docs, use_core_schemas=False).problems]


def test_the_source_documents_pytorchjob_fails_validate_naming_nnodes_and_rank(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "job.yaml"
    f.write_text(SOURCE_DOC)
    assert main(["k8s", "validate", "--structural-only", str(f)]) == 2
    err = capsys.readouterr().err
    assert "--nnodes=2 but the job starts 4 pods: use --nnodes=4" in err
    assert "$RANK is passed literally" in err and "write $(RANK)" in err
    assert "$MASTER_ADDR is passed literally" in err


def test_fixed_source_document_passes() -> None:
    doc = _doc()
    for r in doc["spec"]["pytorchReplicaSpecs"].values():
        r["template"]["spec"]["containers"][0]["command"] = [
            "torchrun", "--nnodes=4", "--nproc_per_node=1", "--node_rank=$(RANK)",
            "/opt/mnist/src/mnist.py",
        ]  # fmt: skip
    report = validate_documents([doc], use_core_schemas=False)
    assert report.ok, [str(p) for p in report.problems]


def test_a_shell_expands_dollar_vars_and_its_launcher_flags_are_still_checked() -> None:
    doc = _doc()
    for r in doc["spec"]["pytorchReplicaSpecs"].values():
        r["template"]["spec"]["containers"][0]["command"] = [
            "/bin/sh", "-c", "torchrun --nnodes 3 --node_rank $RANK /opt/m.py --lr 0.1",
        ]  # fmt: skip
    msgs = _messages([doc])
    assert not any("passed literally" in m for m in msgs)
    assert any("--nnodes=3 but the job starts 4 pods" in m for m in msgs), msgs


def test_elastic_range_must_match_min_and_max_replicas() -> None:
    doc = _doc()
    spec = doc["spec"]
    del spec["pytorchReplicaSpecs"]["Master"]
    spec["elasticPolicy"] = {"minReplicas": 2, "maxReplicas": 8, "rdzvBackend": "c10d"}
    w = spec["pytorchReplicaSpecs"]["Worker"]
    w["template"]["spec"]["containers"][0]["command"] = [
        "flexrun",
        "run",
        "--nnodes",
        "1:4",
        "t.py",
    ]
    msgs = _messages([doc])
    assert any(
        "--nnodes=1:4 but elasticPolicy scales between 2 and 8 pods: use --nnodes=2:8" in m
        for m in msgs
    ), msgs
    w["template"]["spec"]["containers"][0]["command"] = [
        "flexrun",
        "run",
        "--nnodes",
        "2:8",
        "t.py",
    ]
    assert not any("--nnodes" in m for m in _messages([doc]))


def _pod(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]


def test_gpus_against_processes_per_pod_and_dev_shm() -> None:
    doc = _doc()
    del doc["spec"]["pytorchReplicaSpecs"]["Master"]
    doc["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = 2
    c = _pod(doc)["containers"][0]
    c["command"] = ["torchrun", "--nnodes=2", "--nproc-per-node=8", "t.py"]
    c["resources"] = {"limits": {"nvidia.com/gpu": 4}}
    report = validate_documents([doc], use_core_schemas=False)
    gpu = [p for p in report.problems if "nvidia.com/gpu" in p.message]
    assert len(gpu) == 1 and gpu[0].error and "--nproc-per-node 4" in gpu[0].message
    shm = [p for p in report.problems if "/dev/shm" in p.message]
    assert len(shm) == 1 and not shm[0].error and "emptyDir" in shm[0].message
    c["command"] = ["torchrun", "--nnodes=2", "--nproc-per-node=2", "t.py"]
    idle = [
        p
        for p in validate_documents([doc], use_core_schemas=False).problems
        if "GPUs left idle" in p.message
    ]
    assert len(idle) == 1 and not idle[0].error
    c["command"] = ["torchrun", "--nnodes=2", "--nproc-per-node=4", "t.py"]
    c["volumeMounts"] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    _pod(doc)["volumes"] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    assert not any("gpu" in m or "shm" in m for m in _messages([doc]))


@pytest.mark.parametrize(
    ("selector", "notice"),
    [
        ({"cloud.google.com/gke-spot": "true"}, 30),
        ({"eks.amazonaws.com/capacityType": "SPOT"}, 120),
    ],
)
def test_grace_longer_than_the_spot_notice_is_a_warning(
    selector: dict[str, str], notice: int
) -> None:
    doc = _doc()
    pod = _pod(doc)
    pod["nodeSelector"] = selector
    pod["terminationGracePeriodSeconds"] = notice + 1
    found = [
        p
        for p in validate_documents([doc], use_core_schemas=False).problems
        if "reclaim notice" in p.message
    ]
    assert len(found) == 1 and not found[0].error and f"use at most {notice}" in found[0].message
    pod["terminationGracePeriodSeconds"] = notice
    assert not any("reclaim notice" in m for m in _messages([doc]))
    del pod["nodeSelector"]
    pod["terminationGracePeriodSeconds"] = 600  # not on spot nodes: no notice to beat
    assert not any("reclaim notice" in m for m in _messages([doc]))


@pytest.mark.parametrize("example", [EXAMPLE, TRAINJOB_EXAMPLE], ids=["pytorchjob", "trainjob"])
def test_flexrun_renders_raise_no_launch_error(example: Path) -> None:
    docs = render(load_job_spec(example))
    report = validate_documents(copy.deepcopy(docs), use_core_schemas=False)
    assert report.ok, [str(p) for p in report.errors]
    # (the examples keep their grace within GKE spot's 30 s notice: no warning either)
    assert report.problems == (), [str(p) for p in report.problems]


@pytest.mark.parametrize(
    ("argv", "want"),
    [
        (["torchrun", "--nnodes=2", "t.py", "--nnodes", "9"], {"nnodes": "2"}),
        (
            ["python", "-m", "torch.distributed.run", "--nproc_per_node", "4", "t.py"],
            {"nproc": "4"},
        ),
        (["python", "-m", "flexrun", "run", "--nnodes", "1:3", "-m", "pkg"], {"nnodes": "1:3"}),
        (["bash", "-c", "cd /w && torchrun --nnodes=$NN t.py"], {"nnodes": "$NN"}),
        (["python", "t.py", "--nnodes", "3"], None),
        (["sh", "-c", "torchrun 'unclosed"], None),
    ],
)
def test_launcher_options(argv: list[str], want: dict[str, str] | None) -> None:
    assert launcher_options(argv) == want


@pytest.mark.parametrize("bad", [[], {}, 5])
def test_a_non_string_namespace_on_trainer_objects_is_a_problem_not_a_crash(bad: object) -> None:
    # found by test_k8s_fuzz (metadata.namespace: [] made the runtimes' key unhashable)
    docs = render(load_job_spec(TRAINJOB_EXAMPLE))
    for d in docs:
        if d["kind"] in ("TrainingRuntime", "TrainJob"):
            d["metadata"]["namespace"] = bad
    report = validate_documents(docs, use_core_schemas=False)
    assert any("namespace" in p.path for p in report.errors), [str(p) for p in report.problems]
