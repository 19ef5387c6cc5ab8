"""Pipeline -> Argo ``Workflow`` (``argoproj.io/v1alpha1``), as a plain dict.

Owns the cluster form of a pipeline: a DAG whose ordinary stages are container steps and
whose train stage is a ``resource`` step creating the Kubeflow PyTorchJob that
``flexrun.k8s.render`` renders (plus resource steps applying its rendezvous store, which
must outlive any spot node). It does not parse the spec (``spec``) nor run anything.

Cluster semantics, chosen to match the elastic job:

- Every step mounts one ReadWriteMany PVC (``argo.artifacts.claimName``) at
  ``argo.artifacts.mountPath`` and works there: ``{run_dir}`` is that path, so stage
  outputs are the next stage's inputs, and the PyTorchJob's checkpoint volume is the same
  claim (a resumed job finds its checkpoints). A train stage with ``checkpointUrl`` gets
  the job spec's ``checkpoint.url`` / ``storageOptions`` instead (checkpoints in the object
  store, no checkpoint volume) and the artifacts claim is mounted into its workers as a
  plain volume, so relative paths still mean the artifacts, as locally.
- The train step is the job object itself (a PyTorchJob, or with ``k8s.target: trainjob``
  a TrainJob, after the runtime and store objects it needs), named after the stage, so
  later stages depend on the stage's name whatever the target. Argo evaluates a resource
  step's conditions as Kubernetes label selectors over the object's JSON (gjson paths):
  keys are dotted paths without list queries, every requirement of ``successCondition``
  must hold, and the step fails as soon as ANY requirement of ``failureCondition`` holds.
  Conditions are therefore single requirements on fields that are not lists of conditions:
- PyTorchJob: succeeded when any Worker succeeded (``replicaStatuses.Worker.succeeded``):
  an elastic agent exits 0 only once the whole job finished (torchrun semantics; the
  Kubeflow operator marks elastic jobs Succeeded the same way). It has no failure
  condition: the operator's verdict is only in ``status.conditions`` (a list Argo's keys
  cannot search), and ``Worker.failed`` also counts a preempted Worker (exit 143) that the
  operator is about to restart (``restartPolicy: ExitCode``). A job the operator gave up on
  fails the step at the stage's ``timeout`` (``activeDeadlineSeconds``).
- TrainJob: its runtime has one replicated job (``node``), so ``status.jobsStatus`` has one
  entry: succeeded when its child Job succeeded (one pod exited 0, the Job's
  ``successPolicy``), failed when it failed (a permanent exit code or ``backoffLimit``
  spent; the JobSet never restarts, so that is the TrainJob's failure too).
- The train step has no Argo retry (a retry would re-create a job that exists); elastic
  restarts belong to ``maxRestarts`` and the operator. Objects the workflow creates carry
  an owner reference to it, so deleting the workflow deletes them; a mutex named after
  the pipeline keeps two runs from fighting over the same job name and volume.
- A command stage's environment variable that holds a secret (the job secret, the etcd
  password, an object store credential, any ``*SECRET*``/``*PASSWORD*``/``*TOKEN*``
  name) is never written into the Workflow: it becomes a ``secretKeyRef`` to the Secret
  ``<pipeline>-env`` (key: the variable's name), which the user creates.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from flexrun.errors import SpecError
from flexrun.pipeline.spec import Pipeline, Stage, substitute

API_VERSION = "argoproj.io/v1alpha1"
ARTIFACTS_VOLUME = "artifacts"
#: Fields of the flexrun k8s job spec that the pipeline's train block and volume decide.
_OWNED_JOB_FIELDS = (
    "script",
    "module",
    "args",
    "nnodes",
    "nprocPerNode",
    "maxRestarts",
    "checkpoint",
)

#: kind of the train step's object -> (successCondition, failureCondition or None)
JOB_CONDITIONS: dict[str, tuple[str, str | None]] = {
    "PyTorchJob": ("status.replicaStatuses.Worker.succeeded > 0", None),
    "TrainJob": ("status.jobsStatus.0.succeeded > 0", "status.jobsStatus.0.failed > 0"),
}
SUCCESS_CONDITION = JOB_CONDITIONS["PyTorchJob"][0]
_CLUSTER_SCOPED = frozenset({"ClusterTrainingRuntime"})

Manifest = dict[str, Any]
log = logging.getLogger(__name__)

#: Variables whose value is a secret, whatever their name says.
SECRET_ENV = frozenset(
    {
        "FLEXRUN_JOB_SECRET",
        "FLEXRUN_ETCD_PASSWORD",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AZURE_STORAGE_KEY",
        "AZURE_STORAGE_SAS_TOKEN",
        "AZURE_STORAGE_CONNECTION_STRING",
        "AZURE_CLIENT_SECRET",
        "GOOGLE_APPLICATION_CREDENTIALS_JSON",
        "HF_TOKEN",
        "WANDB_API_KEY",
    }
)
_SECRET_WORDS = ("SECRET", "PASSWORD", "PASSWD", "TOKEN", "API_KEY", "PRIVATE_KEY", "CREDENTIAL")


def is_secret_env(name: str) -> bool:
    """Whether variable ``name`` holds a secret's value (``*_FILE``: a path, not a value)."""
    upper = name.upper()
    if upper.endswith("_FILE"):
        return False
    return upper in SECRET_ENV or any(w in upper for w in _SECRET_WORDS)


def env_secret_name(pipeline: Pipeline) -> str:
    """The Secret that holds the values of the stages' secret variables."""
    return f"{pipeline.name}-env"


def _env_entries(pipeline: Pipeline, stage: Stage, env: Mapping[str, str]) -> list[Manifest]:
    out: list[Manifest] = []
    for k, v in env.items():
        if is_secret_env(k):
            secret = env_secret_name(pipeline)
            log.warning(
                "stages.%s.env.%s: rendered as a reference to key %s of Secret %s, not its "
                "value; create it: kubectl create secret generic %s --from-literal=%s=...",
                stage.name,
                k,
                k,
                secret,
                secret,
                k,
            )
            out.append({"name": k, "valueFrom": {"secretKeyRef": {"name": secret, "key": k}}})
        else:
            out.append({"name": k, "value": v})
    return out


def _values(pipeline: Pipeline) -> dict[str, str]:
    return {
        "python": "python",
        "pipeline_dir": pipeline.argo.pipeline_dir,
        "run_dir": pipeline.argo.mount_path,
    }


def claim_name(pipeline: Pipeline) -> str:
    """The artifacts PVC every step mounts."""
    return pipeline.argo.claim_name or f"{pipeline.name}-artifacts"


def _env(pipeline: Pipeline, stage: Stage) -> dict[str, str]:
    env = dict(pipeline.env)
    env.update(stage.env)
    return {k: substitute(v, _values(pipeline), f"stages.{stage.name}.env") for k, v in env.items()}


def _image(pipeline: Pipeline, where: str) -> str:
    if pipeline.argo.image is None:
        raise SpecError(
            f"{where}: argo.image is required to render for Argo (the image with "
            "flexrun and the stage scripts)"
        )
    return pipeline.argo.image


def _container_template(pipeline: Pipeline, stage: Stage) -> Manifest:
    assert stage.command is not None
    values = _values(pipeline)
    argv = [substitute(a, values, f"stages.{stage.name}.command") for a in stage.command]
    container: Manifest = {
        "name": "main",
        "image": _image(pipeline, f"stages.{stage.name}"),
        "command": argv[:1],
        "args": argv[1:],
        "workingDir": pipeline.argo.mount_path,
    }
    env = _env(pipeline, stage)
    if env:
        container["env"] = _env_entries(pipeline, stage, env)
    container["volumeMounts"] = [{"name": ARTIFACTS_VOLUME, "mountPath": pipeline.argo.mount_path}]
    template: Manifest = {
        "name": stage.name,
        "activeDeadlineSeconds": str(int(stage.timeout_s)),  # IntOrString: a string validates
        "container": container,
    }
    if stage.retries:
        template["retryStrategy"] = {"limit": str(stage.retries), "retryPolicy": "OnFailure"}
    return template


def train_job_spec(pipeline: Pipeline, stage: Stage) -> Manifest:
    """The flexrun k8s job spec (``TrainingJob``) of a train stage, as parsed YAML."""
    from flexrun.k8s.spec import API_VERSION as JOB_API
    from flexrun.k8s.spec import KIND as JOB_KIND

    train = stage.train
    assert train is not None
    where = f"stages.{stage.name}.train"
    for key in _OWNED_JOB_FIELDS:
        if key in train.k8s:
            raise SpecError(
                f"{where}.k8s.{key}: set by the pipeline (train block, artifacts volume)"
            )
    values = _values(pipeline)
    extra = dict(train.k8s)
    from flexrun.k8s.spec import OPERATOR_ENV

    # The operator sets these itself (PYTHONUNBUFFERED, PET_*): a pipeline-wide value is
    # meant for the container steps; an explicit train.k8s.env entry is still an error.
    env = {k: v for k, v in _env(pipeline, stage).items() if k not in OPERATOR_ENV}
    user_env = extra.pop("env", None) or {}
    if not isinstance(user_env, Mapping):
        raise SpecError(f"{where}.k8s.env: must be a mapping")
    env.update({str(k): str(v) for k, v in user_env.items()})
    metadata: Manifest = {"name": f"{pipeline.name}-{stage.name}"}
    if pipeline.argo.namespace is not None:
        metadata["namespace"] = pipeline.argo.namespace
    spec: Manifest = {
        "image": extra.pop("image", None) or _image(pipeline, where),
        "script": substitute(train.script, values, f"{where}.script"),
        "args": [substitute(a, values, f"{where}.args") for a in train.args],
        "nnodes": train.nnodes,
        "nprocPerNode": train.nproc_per_node,
        "maxRestarts": train.max_restarts,
        "checkpoint": _checkpoint(pipeline, stage),
    }
    if env:
        spec["env"] = env
    spec.update(extra)
    return {"apiVersion": JOB_API, "kind": JOB_KIND, "metadata": metadata, "spec": spec}


def _checkpoint(pipeline: Pipeline, stage: Stage) -> Manifest:
    train = stage.train
    assert train is not None
    if train.checkpoint_url is None:
        return {"existingClaim": claim_name(pipeline), "mountPath": pipeline.argo.mount_path}
    out: Manifest = {"url": train.checkpoint_url}
    if train.storage_options:
        out["storageOptions"] = dict(train.storage_options)
    return out


def _mount_artifacts(pipeline: Pipeline, pod: Manifest, container: Manifest) -> None:
    """A url checkpoint leaves the workers without the artifacts claim: mount it."""
    pod.setdefault("volumes", []).append(
        {"name": ARTIFACTS_VOLUME, "persistentVolumeClaim": {"claimName": claim_name(pipeline)}}
    )
    container.setdefault("volumeMounts", []).append(
        {"name": ARTIFACTS_VOLUME, "mountPath": pipeline.argo.mount_path}
    )


def _worker_pod(manifest: Manifest) -> tuple[Manifest, str] | None:
    """The worker pod spec of a rendered job object and its container's name, or None."""
    from flexrun.k8s.render import CONTAINER_NAME
    from flexrun.k8s.trainjob import NODE

    if manifest["kind"] == "PyTorchJob":
        return manifest["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"], CONTAINER_NAME
    if manifest["kind"] in ("TrainingRuntime", "ClusterTrainingRuntime"):
        rjobs = manifest["spec"]["template"]["spec"]["replicatedJobs"]
        return rjobs[0]["template"]["spec"]["template"]["spec"], NODE
    return None


def render_train_manifests(pipeline: Pipeline, stage: Stage) -> list[Manifest]:
    """The train stage's objects: rendezvous store objects, then the job (a PyTorchJob, or
    a training runtime and the TrainJob referencing it).

    Raises:
        SpecError: the train block does not make a valid k8s job (the field is named).
    """
    from flexrun.k8s.render import render
    from flexrun.k8s.spec import parse_job_spec

    where = f"stages.{stage.name}.train"
    try:
        job = parse_job_spec(train_job_spec(pipeline, stage))
    except SpecError as exc:
        raise SpecError(f"{where}: as a Kubernetes job: {exc}") from None
    manifests = render(job)
    for m in manifests:
        found = _worker_pod(m)
        if found is None:
            continue
        pod, name = found
        for c in pod["containers"]:
            if c["name"] == name:
                # Relative paths in the args mean the shared artifacts volume, as locally.
                c["workingDir"] = pipeline.argo.mount_path
                if stage.train is not None and stage.train.checkpoint_url is not None:
                    _mount_artifacts(pipeline, pod, c)
    from flexrun.k8s.validate import validate_documents

    # Never emit a workflow whose job the operator would reject (structural checks only:
    # they need no optional package; the tests also run Kubernetes' own schemas).
    report = validate_documents(manifests, use_core_schemas=False)
    if report.errors:
        raise SpecError(f"{where}: the rendered job is invalid: {report.errors[0]}")
    return manifests


def _resource_template(
    name: str, manifest: Manifest, action: str, timeout_s: float | None
) -> Manifest:
    from flexrun.k8s.render import to_yaml

    resource: Manifest = {
        "action": action,
        # A namespaced Workflow cannot own a cluster-scoped object (the garbage collector
        # would treat the reference as unresolvable): a ClusterTrainingRuntime outlives it.
        "setOwnerReference": manifest["kind"] not in _CLUSTER_SCOPED,
        "manifest": to_yaml([manifest]),
    }
    conditions = JOB_CONDITIONS.get(manifest["kind"])
    if conditions is not None:
        resource["successCondition"] = conditions[0]
        if conditions[1] is not None:
            resource["failureCondition"] = conditions[1]
    template: Manifest = {"name": name, "resource": resource}
    if timeout_s is not None:
        template["activeDeadlineSeconds"] = str(int(timeout_s))
    return template


def render_workflow(pipeline: Pipeline) -> Manifest:
    """The whole pipeline as one Argo Workflow.

    Raises:
        SpecError: ``argo.image`` is missing or a train stage is not a valid k8s job.
    """
    templates: list[Manifest] = []
    tasks: list[Manifest] = []
    train_step: dict[str, str] = {}  # stage -> the task later stages depend on
    for stage in pipeline.stages:
        deps = sorted({train_step.get(d, d) for d in stage.deps})
        if stage.command is not None:
            templates.append(_container_template(pipeline, stage))
            task: Manifest = {"name": stage.name, "template": stage.name}
            if deps:
                task["dependencies"] = deps
            tasks.append(task)
            continue
        store_tasks: list[str] = []
        used: set[str] = set()
        for m in render_train_manifests(pipeline, stage):
            if m["kind"] in JOB_CONDITIONS:
                templates.append(_resource_template(stage.name, m, "create", stage.timeout_s))
                task = {"name": stage.name, "template": stage.name}
                if deps or store_tasks:
                    task["dependencies"] = sorted(set(deps) | set(store_tasks))
                tasks.append(task)
                continue
            base = f"{stage.name}-{m['kind'].lower()}"
            name, i = base, 2
            while name in used:
                name, i = f"{base}-{i}", i + 1
            used.add(name)
            templates.append(_resource_template(name, m, "apply", None))
            store_task: Manifest = {"name": name, "template": name}
            if deps:
                store_task["dependencies"] = deps
            tasks.append(store_task)
            store_tasks.append(name)
        train_step[stage.name] = stage.name
    metadata: Manifest = {
        "generateName": f"{pipeline.name}-",
        "labels": {
            "app.kubernetes.io/name": "flexrun",
            "app.kubernetes.io/instance": pipeline.name,
        },
    }
    if pipeline.argo.namespace is not None:
        metadata["namespace"] = pipeline.argo.namespace
    spec: Manifest = {"entrypoint": "main"}
    if pipeline.argo.service_account is not None:
        spec["serviceAccountName"] = pipeline.argo.service_account
    spec["synchronization"] = {"mutexes": [{"name": pipeline.name}]}
    spec["volumes"] = [
        {"name": ARTIFACTS_VOLUME, "persistentVolumeClaim": {"claimName": claim_name(pipeline)}}
    ]
    spec["templates"] = [{"name": "main", "dag": {"tasks": tasks}}, *templates]
    return {"apiVersion": API_VERSION, "kind": "Workflow", "metadata": metadata, "spec": spec}


def embedded_manifests(workflow: Mapping[str, Any]) -> list[Any]:
    """Every object a workflow's resource steps create (parsed), in template order."""
    import yaml

    out: list[Any] = []
    for t in workflow["spec"]["templates"]:
        resource = t.get("resource")
        if resource is not None:
            out.extend(d for d in yaml.safe_load_all(resource["manifest"]) if d is not None)
    return out


def to_yaml(workflow: Manifest) -> str:
    """The workflow as YAML (keys in insertion order, no anchors)."""
    from flexrun.k8s.render import to_yaml as k8s_to_yaml

    return k8s_to_yaml([workflow])
