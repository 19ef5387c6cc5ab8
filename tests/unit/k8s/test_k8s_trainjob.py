"""The Trainer v2 target: golden files, the launcher command, and the failure policy.

The failure policy is checked by evaluating it the way the Job controller does (first
matching rule wins; no match counts against backoffLimit) for each of flexrun's exit codes.
Regenerate the golden files with ``FLEXRUN_UPDATE_GOLDEN=1`` and review the diff.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import yaml
from k8s_paths import GOLDEN, TRAINJOB_EXAMPLE

from flexrun import exitcodes
from flexrun.errors import SpecError
from flexrun.k8s.commands import main
from flexrun.k8s.render import render, to_yaml
from flexrun.k8s.spec import OPERATOR_ENV, load_job_spec, parse_job_spec
from flexrun.k8s.trainjob import UNLIMITED_BACKOFF
from flexrun.k8s.validate import validate_documents

pytestmark = pytest.mark.timeout(60)

Doc = dict[str, Any]
TRAINJOB_GOLDEN = ["trainjob", "trainjob-etcd", "trainjob-objstore"]


def _kinds(docs: list[Doc]) -> dict[str, Doc]:
    return {d["kind"]: d for d in docs}


def _node_job(runtime: Doc) -> Doc:
    (job,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    return job


def _node_container(runtime: Doc) -> Doc:
    (container,) = _node_job(runtime)["template"]["spec"]["template"]["spec"]["containers"]
    return container


@pytest.mark.parametrize("name", TRAINJOB_GOLDEN)
def test_rendered_trainjob_matches_golden_file(name: str) -> None:
    text = to_yaml(render(load_job_spec(GOLDEN / f"{name}.job.yaml")))
    golden = GOLDEN / f"{name}.yaml"
    if os.environ.get("FLEXRUN_UPDATE_GOLDEN") == "1":
        golden.write_text(text, encoding="utf-8")
    assert text == golden.read_text(encoding="utf-8"), (
        f"{golden.name} differs; if intended, regenerate with FLEXRUN_UPDATE_GOLDEN=1"
    )
    assert list(yaml.safe_load_all(text)) == render(load_job_spec(GOLDEN / f"{name}.job.yaml"))


@pytest.mark.parametrize("name", TRAINJOB_GOLDEN)
def test_rendered_trainjob_set_is_valid(name: str) -> None:
    docs = render(load_job_spec(GOLDEN / f"{name}.job.yaml"))
    report = validate_documents(docs)
    assert report.problems == (), [str(p) for p in report.problems]


def test_objects_come_in_apply_order_runtime_before_the_trainjob() -> None:
    kinds = [d["kind"] for d in render(load_job_spec(GOLDEN / "trainjob.job.yaml"))]
    assert kinds == [
        "PersistentVolumeClaim",
        "Secret",
        "Deployment",
        "Service",
        "NetworkPolicy",
        "TrainingRuntime",
        "TrainJob",
    ]


def test_trainjob_references_the_rendered_runtime_and_names_what_runs() -> None:
    spec = load_job_spec(GOLDEN / "trainjob.job.yaml")
    kinds = _kinds(render(spec))
    runtime, job = kinds["TrainingRuntime"], kinds["TrainJob"]
    assert job["apiVersion"] == runtime["apiVersion"] == "trainer.kubeflow.org/v1alpha1"
    assert job["spec"]["runtimeRef"] == {
        "apiGroup": "trainer.kubeflow.org",
        "kind": "TrainingRuntime",
        "name": runtime["metadata"]["name"],
    }
    assert runtime["metadata"]["namespace"] == job["metadata"]["namespace"] == "training"
    trainer = job["spec"]["trainer"]
    assert trainer["args"] == ["train.py", "--config", "configs/7b.yaml"]
    assert trainer["numNodes"] == spec.replicas == runtime["spec"]["mlPolicy"]["numNodes"]
    assert trainer["numProcPerNode"] == 8  # -> PET_NPROC_PER_NODE, which flexrun takes
    assert trainer["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == 8
    assert "command" not in trainer  # the runtime's launcher stays in charge
    assert runtime["spec"]["mlPolicy"]["torch"] == {}


def test_node_container_runs_flexrun_with_its_own_rendezvous_settings() -> None:
    spec = load_job_spec(GOLDEN / "trainjob.job.yaml")
    runtime = _kinds(render(spec))["TrainingRuntime"]
    container = _node_container(runtime)
    assert container["name"] == "node"
    cmd = container["command"]
    assert cmd[:2] == ["flexrun", "run"] and "args" not in container

    def flag(name: str) -> str:
        return cmd[cmd.index(name) + 1]

    # These win over the torch plugin's static PET_NNODES / PET_MASTER_* (CLI > PET_*).
    assert flag("--nnodes") == "2:4"
    assert flag("--rdzv-backend") == "c10d"
    assert flag("--rdzv-endpoint") == "llm-tj-store:29400"
    assert flag("--rdzv-id") == "llm-tj"
    assert flag("--max-restarts") == "5"
    assert flag("--local-addr") == "$(POD_IP)" and flag("--stop-grace") == "20"
    assert "--nproc-per-node" not in cmd  # numeric: from PET_NPROC_PER_NODE
    assert "--metrics-host" not in cmd and "--metrics-port" not in cmd
    assert not {e["name"] for e in container["env"]} & OPERATOR_ENV
    pod = _node_job(runtime)["template"]["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    assert pod["terminationGracePeriodSeconds"] == 30
    assert pod["tolerations"][0]["key"] == "cloud.google.com/gke-spot"
    assert pod["nodeSelector"] == {"cloud.google.com/gke-spot": "true"}
    labels = _node_job(runtime)["template"]["metadata"]["labels"]
    assert labels["trainer.kubeflow.org/trainjob-ancestor-step"] == "trainer"


def test_a_nproc_word_goes_on_the_command_line_and_metrics_bind_all_interfaces() -> None:
    kinds = _kinds(render(load_job_spec(GOLDEN / "trainjob-etcd.job.yaml")))
    runtime = kinds["ClusterTrainingRuntime"]
    cmd = _node_container(runtime)["command"]
    assert cmd[cmd.index("--nproc-per-node") + 1] == "gpu"
    assert "numProcPerNode" not in kinds["TrainJob"]["spec"]["trainer"]
    assert cmd[cmd.index("--metrics-port") + 1] == "9400"
    assert cmd[cmd.index("--metrics-host") + 1] == "0.0.0.0"
    assert cmd[cmd.index("--rdzv-backend") + 1] == "etcd-v3"
    conf = cmd[cmd.index("--rdzv-conf") + 1]
    assert conf.startswith("join_timeout=900,cacert=/var/run/flexrun/etcd/ca.crt,")
    assert "namespace" not in runtime["metadata"]  # cluster-scoped
    assert runtime["metadata"]["name"] == "ml-llm-tje-runtime"
    assert kinds["TrainJob"]["spec"]["runtimeRef"]["kind"] == "ClusterTrainingRuntime"


def _action(policy: Doc, *, exit_code: int, disrupted: bool = False) -> str:
    """The Job controller's pod failure policy evaluation: first match wins."""
    for rule in policy["rules"]:
        for cond in rule.get("onPodConditions", []):
            if disrupted and cond["type"] == "DisruptionTarget" and cond["status"] == "True":
                return str(rule["action"])
        codes = rule.get("onExitCodes")
        if codes is not None and codes["containerName"] == "node":
            hit = exit_code in codes["values"]
            if hit == (codes["operator"] == "In"):
                return str(rule["action"])
    return "Count"  # no rule matched: the failure counts against backoffLimit


@pytest.mark.parametrize(
    ("exit_code", "disrupted", "action"),
    [
        (exitcodes.PREEMPTED, False, "Ignore"),  # 143: spot reclaim, SIGTERM
        (137, True, "Ignore"),  # pod lost with its node (DisruptionTarget)
        (1, True, "Ignore"),  # a disruption wins even over a failing exit code
        (1, False, "FailJob"),  # a script bug once flexrun's restarts are spent
        (exitcodes.BAD_INPUT, False, "FailJob"),
        (exitcodes.NO_PROGRESS, False, "FailJob"),  # 86: crash loop, do not requeue
        (127, False, "FailJob"),
        (exitcodes.NODE_LOST, False, "Count"),  # 200: a static job lost a node
        (137, False, "Count"),  # kill -9 / OOM of the agent: retry, counted
    ],
)
def test_pod_failure_policy_recreates_only_what_should_be_recreated(
    exit_code: int, disrupted: bool, action: str
) -> None:
    runtime = _kinds(render(load_job_spec(GOLDEN / "trainjob.job.yaml")))["TrainingRuntime"]
    job = _node_job(runtime)["template"]["spec"]
    assert _action(job["podFailurePolicy"], exit_code=exit_code, disrupted=disrupted) == action


def test_job_and_jobset_policies_never_recreate_every_pod() -> None:
    runtime = _kinds(render(load_job_spec(GOLDEN / "trainjob.job.yaml")))["TrainingRuntime"]
    job = _node_job(runtime)["template"]["spec"]
    assert job["completionMode"] == "Indexed"  # a recreated pod keeps its index
    assert job["podReplacementPolicy"] == "Failed"  # never two pods of one index
    assert job["backoffLimit"] == UNLIMITED_BACKOFF  # the spec sets none
    assert job["successPolicy"] == {"rules": [{"succeededCount": 1}]}
    policy = runtime["spec"]["template"]["spec"]["failurePolicy"]
    assert policy["maxRestarts"] == 0  # the JobSet is never restarted as a whole
    assert {r["action"] for r in policy["rules"]} == {"FailJobSet"}
    reasons = {x for r in policy["rules"] for x in r["onJobFailureReasons"]}
    assert reasons == {"PodFailurePolicy", "BackoffLimitExceeded"}
    backoff = _node_job(
        _kinds(render(load_job_spec(GOLDEN / "trainjob-etcd.job.yaml")))["ClusterTrainingRuntime"]
    )["template"]["spec"]["backoffLimit"]
    assert backoff == 50


def test_example_trainjob_spec_renders_valid_manifests() -> None:
    docs = render(load_job_spec(TRAINJOB_EXAMPLE))
    assert {"TrainingRuntime", "TrainJob", "NetworkPolicy", "Secret"} <= {d["kind"] for d in docs}
    assert validate_documents(docs).problems == ()


MINIMAL: Doc = {
    "metadata": {"name": "job"},
    "spec": {"image": "img:1", "script": "train.py", "nnodes": "1:3"},
}


def test_cli_target_and_runtime_kind_override_the_spec(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "job.yaml"
    f.write_text(yaml.safe_dump(MINIMAL))
    assert main(["k8s", "render", str(f), "--target", "trainjob"]) == 0
    kinds = [d["kind"] for d in yaml.safe_load_all(capsys.readouterr().out)]
    assert kinds[-2:] == ["TrainingRuntime", "TrainJob"]
    args = [
        "k8s",
        "render",
        str(f),
        "--target",
        "trainjob",
        "--runtime-kind",
        "ClusterTrainingRuntime",
    ]
    assert main(args) == 0
    kinds = [d["kind"] for d in yaml.safe_load_all(capsys.readouterr().out)]
    assert kinds[-2:] == ["ClusterTrainingRuntime", "TrainJob"]
    assert main(["k8s", "render", str(f)]) == 0
    assert [d["kind"] for d in yaml.safe_load_all(capsys.readouterr().out)][-1] == "PyTorchJob"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"target": "slurm"}, "spec.target: 'slurm' not one of pytorchjob, trainjob"),
        (
            {"target": "trainjob", "hpa": {"metrics": [{"type": "Resource"}]}},
            "spec.hpa: only with target pytorchjob",
        ),
        (
            {"target": "trainjob", "trainJob": {"runtimeKind": "Runtime"}},
            "spec.trainJob.runtimeKind",
        ),
        ({"rdzvConf": {"password": "hunter2"}}, "spec.rdzvConf.password: a secret value"),
        (
            {"store": {"type": "etcd"}, "rdzvConf": {"cacert": "/x"}},
            "spec.rdzvConf.cacert: is set by flexrun k8s render",
        ),
        ({"store": {"existingSecret": "s"}}, "spec.store.existingSecret: only for type etcd"),
        ({"metrics": {"port": 0}}, "spec.metrics.port: must be 1..65535"),
        ({"metrics": {}}, "spec.metrics.port: is required"),
        ({"networkPolicy": "yes"}, "spec.networkPolicy: must be true or false"),
        ({"env": {"FLEXRUN_JOB_SECRET_FILE": "/x"}}, "spec.env.FLEXRUN_JOB_SECRET_FILE"),
        ({"env": {"JOB_COMPLETION_INDEX": "0"}}, "spec.env.JOB_COMPLETION_INDEX"),
    ],
)
def test_bad_trainjob_and_security_fields_name_the_field(spec: Doc, message: str) -> None:
    doc = {"metadata": MINIMAL["metadata"], "spec": {**MINIMAL["spec"], **spec}}
    with pytest.raises(SpecError) as info:
        parse_job_spec(doc)
    assert str(info.value).startswith(message), str(info.value)


def test_a_name_too_long_for_jobset_pod_names_is_refused_for_trainjobs_only() -> None:
    name = "a" * 50
    doc = {"metadata": {"name": name}, "spec": {**MINIMAL["spec"]}}
    assert parse_job_spec(doc).name == name  # fine for a PyTorchJob
    with pytest.raises(
        SpecError, match=r"^metadata.name: .* too long for a TrainJob: .* at most 48"
    ):
        parse_job_spec(doc, target="trainjob")


def _runtime_pod(docs: list[Doc]) -> Doc:
    runtime = next(d for d in docs if d["kind"] == "TrainingRuntime")
    return _node_job(runtime)["template"]["spec"]["template"]["spec"]


CLI_BROKEN = {
    "wrong_type": (
        lambda d: _kinds(d)["TrainJob"]["spec"]["trainer"].update(numNodes="4"),
        "TrainJob/llm-tj: spec.trainer.numNodes: '4' is not of type 'integer'",
    ),
    "missing_node_container": (
        lambda d: _runtime_pod(d)["containers"][0].update(name="main"),
        "TrainingRuntime/llm-tj-runtime: spec.template.spec.replicatedJobs[0].template.spec."
        "template.spec.containers: no container named 'node' (found main)",
    ),
    "unknown_runtime": (
        lambda d: d.remove(_kinds(d)["TrainingRuntime"]),
        "TrainJob/llm-tj: spec.runtimeRef.name: unknown runtime reference: "
        "TrainingRuntime/llm-tj-runtime is not among these manifests",
    ),
}


@pytest.mark.parametrize("case", sorted(CLI_BROKEN))
def test_cli_validate_reports_a_broken_trainjob_with_the_path_and_exits_2(
    case: str, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    mutate, expected = CLI_BROKEN[case]
    docs = render(load_job_spec(GOLDEN / "trainjob.job.yaml"))
    mutate(docs)
    f = tmp_path / "m.yaml"
    f.write_text(to_yaml(docs))
    assert main(["k8s", "validate", "-q", str(f)]) == 2
    err = capsys.readouterr().err
    assert f"{f}: {expected}" in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("flexrun: error:") and expected in last
