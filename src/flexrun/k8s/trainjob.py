"""The Kubeflow Trainer v2 target: a ``TrainJob`` and the runtime it references (v2.3.0).

Owns the shape of both objects (``trainer.kubeflow.org/v1alpha1``): a ``TrainingRuntime``
(or ``ClusterTrainingRuntime``) with ``mlPolicy.torch`` and one replicated job ``node``
whose container ``node`` runs the flexrun agent, and a ``TrainJob`` that references it
and names the script, the pod count and the resources.

Trainer v2 has no elastic PyTorch: its torch plugin starts ``numNodes`` pods and injects
static ``PET_NNODES``/``PET_NODE_RANK``/``PET_MASTER_*``. The runtime therefore passes
flexrun's own settings on the command line (``--nnodes MIN:MAX --rdzv-backend ...
--rdzv-endpoint <store Service> --rdzv-id <job>``), which win over those variables
(CLI > PET_* > default), while ``PET_NPROC_PER_NODE`` (from ``numProcPerNode``) is used.

The failure policy is the point of this target. JobSet's default recreates every pod
when one fails; here nothing is recreated but the failed pod, and only when that is
right (flexrun's exit codes, ``flexrun.exitcodes``):

- The child Job's ``podFailurePolicy`` (first match wins): a pod with the
  ``DisruptionTarget`` condition (its node drained, lost or the pod preempted) is
  ``Ignore``: recreated with the same completion index, not counted; exit 143 (SIGTERM of
  a preemption) likewise; exit 1..127 (a script bug once flexrun's own restarts are spent,
  2 bad input, 86 a crash loop) is ``FailJob``; exit 200 (a static job lost a node) and any
  other 128+N is ``Count``ed against ``backoffLimit`` and the pod recreated. Pod
  replacement waits for the old pod to be gone (``podReplacementPolicy: Failed``), so one
  index never runs twice.
- The Job succeeds when one pod exits 0 (``successPolicy``): a flexrun agent exits 0 only
  once the whole job finished, so a replacement still starting is not waited for.
- The JobSet's ``failurePolicy`` never restarts the set (``maxRestarts: 0``): a Job that
  failed through its pod failure policy or spent its ``backoffLimit`` fails the TrainJob.
"""

from __future__ import annotations

from typing import Any

from flexrun import exitcodes
from flexrun.k8s.objects import (
    Manifest,
    job_meta,
    meta,
    store_port,
    store_service_name,
    worker_rdzv_conf,
)
from flexrun.k8s.pods import entrypoint as script_argv
from flexrun.k8s.pods import (
    pod_flags,
    resources,
    worker_container,
    worker_pod_metadata,
    worker_pod_spec,
)
from flexrun.k8s.spec import JobSpec
from flexrun.k8s.spec_types import NPROC_WORDS

API_VERSION = "trainer.kubeflow.org/v1alpha1"
API_GROUP = "trainer.kubeflow.org"
#: The replicated job and the container the torch plugin injects PET_* into.
NODE = "node"
ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"
#: Job failure reasons JobSet's failure policy can match (batch/v1 Job conditions).
JOB_FAILURE_REASONS = (
    "BackoffLimitExceeded",
    "DeadlineExceeded",
    "FailedIndexes",
    "MaxFailedIndexesExceeded",
    "PodFailurePolicy",
)
#: backoffLimit when the spec sets none ("unlimited"; ignored failures never count).
UNLIMITED_BACKOFF = 2**31 - 1
#: A failed worker's own code once restarts are spent, bad input, a crash loop: permanent.
PERMANENT_EXIT_CODES = list(range(1, exitcodes.SIGNAL_BASE))


def runtime_name(spec: JobSpec) -> str:
    """The name of the rendered runtime (a ClusterTrainingRuntime's is cluster-wide)."""
    if spec.trainjob.runtime_kind == "ClusterTrainingRuntime" and spec.namespace is not None:
        return f"{spec.namespace}-{spec.name}-runtime"
    return f"{spec.name}-runtime"


def launcher_command(spec: JobSpec) -> list[str]:
    """``flexrun run`` with every setting the static PET_* must not decide."""
    cmd = [
        "flexrun",
        "run",
        "--nnodes",
        str(spec.nnodes),
        "--rdzv-backend",
        spec.rdzv_backend,
        "--rdzv-endpoint",
        f"{store_service_name(spec)}:{store_port(spec)}",
        "--rdzv-id",
        spec.name,
        "--max-restarts",
        str(spec.max_restarts),
    ]
    conf = worker_rdzv_conf(spec)
    if conf:
        cmd += ["--rdzv-conf", ",".join(f"{k}={v}" for k, v in conf)]
    if spec.nproc_per_node in NPROC_WORDS:
        # numProcPerNode is an integer in v2.3.0: a word goes on the command line.
        cmd += ["--nproc-per-node", spec.nproc_per_node]
    return [*cmd, *pod_flags(spec)]


def pod_failure_policy() -> dict[str, Any]:
    """Which pod failures recreate only that pod, which count, which fail the job."""

    def codes(operator: str, values: list[int]) -> dict[str, Any]:
        return {"containerName": NODE, "operator": operator, "values": values}

    return {
        "rules": [
            {
                # Node drained, lost or preempted by the scheduler: not the job's fault.
                "action": "Ignore",
                "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
            },
            {"action": "Ignore", "onExitCodes": codes("In", [exitcodes.PREEMPTED])},
            {"action": "FailJob", "onExitCodes": codes("In", PERMANENT_EXIT_CODES)},
            {"action": "Count", "onExitCodes": codes("In", [exitcodes.NODE_LOST])},
        ]
    }


def failure_policy() -> dict[str, Any]:
    """The JobSet's: never recreate every pod; a failed child Job fails the TrainJob."""
    return {
        "maxRestarts": 0,
        "rules": [
            {
                # exit 1..127: a script bug, bad input, a crash loop.
                "name": "permanentFailure",
                "action": "FailJobSet",
                "onJobFailureReasons": ["PodFailurePolicy"],
                "targetReplicatedJobs": [NODE],
            },
            {
                "name": "retriesSpent",
                "action": "FailJobSet",
                "onJobFailureReasons": ["BackoffLimitExceeded"],
                "targetReplicatedJobs": [NODE],
            },
        ],
    }


def render_runtime(spec: JobSpec) -> Manifest:
    """The ``TrainingRuntime`` (or ``ClusterTrainingRuntime``) the TrainJob references."""
    kind = spec.trainjob.runtime_kind
    container = worker_container(
        spec, name=NODE, command=launcher_command(spec), args=None, with_resources=False
    )
    job_spec: dict[str, Any] = {
        "completionMode": "Indexed",
        "backoffLimit": UNLIMITED_BACKOFF if spec.backoff_limit is None else spec.backoff_limit,
        "podReplacementPolicy": "Failed",
        "podFailurePolicy": pod_failure_policy(),
        "successPolicy": {"rules": [{"succeededCount": 1}]},
        "template": {
            "metadata": worker_pod_metadata(spec),
            "spec": worker_pod_spec(spec, container, restart_policy="Never"),
        },
    }
    metadata = meta(spec, runtime_name(spec), "runtime", namespaced=kind == "TrainingRuntime")
    metadata["labels"]["trainer.kubeflow.org/framework"] = "torch"
    return {
        "apiVersion": API_VERSION,
        "kind": kind,
        "metadata": metadata,
        "spec": {
            "mlPolicy": {"numNodes": spec.replicas, "torch": {}},
            "template": {
                "spec": {
                    "failurePolicy": failure_policy(),
                    "replicatedJobs": [
                        {
                            "name": NODE,
                            "template": {
                                "metadata": {"labels": {ANCESTOR_LABEL: "trainer"}},
                                "spec": job_spec,
                            },
                        }
                    ],
                }
            },
        },
    }


def render_job(spec: JobSpec) -> Manifest:
    """The ``TrainJob``: what runs (image, script and arguments), on how many pods."""
    trainer: dict[str, Any] = {
        "image": spec.image,
        "args": script_argv(spec),
        "numNodes": spec.replicas,
    }
    if spec.nproc_per_node not in NPROC_WORDS:
        trainer["numProcPerNode"] = int(spec.nproc_per_node)
    if res := resources(spec):
        trainer["resourcesPerNode"] = res
    return {
        "apiVersion": API_VERSION,
        "kind": "TrainJob",
        "metadata": job_meta(spec),
        "spec": {
            "runtimeRef": {
                "apiGroup": API_GROUP,
                "kind": spec.trainjob.runtime_kind,
                "name": runtime_name(spec),
            },
            "trainer": trainer,
            # Kueue un-suspends it once the whole job is admitted
            **({"suspend": True} if spec.scheduling.queue is not None else {}),
        },
    }


def render_trainjob(spec: JobSpec) -> list[Manifest]:
    """The runtime, then the TrainJob (the controller resolves the reference on admission)."""
    return [render_runtime(spec), render_job(spec)]


__all__ = [
    "ANCESTOR_LABEL",
    "API_VERSION",
    "NODE",
    "failure_policy",
    "launcher_command",
    "pod_failure_policy",
    "render_job",
    "render_runtime",
    "render_trainjob",
    "runtime_name",
]
