"""Job spec -> Kubernetes manifests (plain dicts) -> YAML.

Owns the choice of objects for a spec and their order, the ``PyTorchJob`` target
(``kubeflow.org/v1``, elastic, Workers only) and the YAML writer. The supporting objects
(store, Secrets, NetworkPolicies, PVC) are built in ``objects.py``, the worker pods in
``pods.py``, the Trainer v2 target (``TrainJob`` + its runtime) in ``trainjob.py``. It does
not parse or check the user's spec (``spec.py``) nor validate manifests (``validate.py``);
output is deterministic so golden files can pin it.

PyTorchJob design choices an operator of the cluster should know:

- Workers run ``flexrun run <script>`` with only the flags of ``pods.pod_flags``: the
  Kubeflow operator injects the ``PET_*`` variables (nnodes, nproc, rendezvous
  backend/endpoint/id/conf, max restarts) from ``elasticPolicy`` and ``spec.nprocPerNode``,
  and the launcher defaults every option from them, exactly as torchrun does.
- ``rdzvHost`` points at flexrun's own store Service. The operator's default endpoint is
  ``<job>-worker-0``, a spot pod: losing it would lose the rendezvous.
- ``restartPolicy: ExitCode``: a preempted pod exits 143 (128 + SIGTERM), a static job
  that lost a node 200, and the operator re-creates it; a script bug exits 1..127 (bad
  input 2, a crash loop 86) and is not retried.
"""

from __future__ import annotations

from typing import Any

from flexrun.k8s import trainjob
from flexrun.k8s.objects import (
    ETCD_CLIENT_PORT,
    ETCD_IMAGE,
    ETCD_MEMBERS,
    ETCD_PEER_PORT,
    Manifest,
    fresh,
    job_meta,
    labels,
    store_port,
    store_service_name,
    supporting_objects,
    worker_rdzv_conf,
)
from flexrun.k8s.pods import (
    AGENT_EXIT_MARGIN_S,
    entrypoint,
    pod_flags,
    stop_grace_s,
    worker_container,
    worker_pod_metadata,
    worker_pod_spec,
)
from flexrun.k8s.spec import JobSpec
from flexrun.k8s.spec_types import TARGET_TRAINJOB

#: The container the Kubeflow v1 operator injects its PET_* variables into.
CONTAINER_NAME = "pytorch"


def render_pytorchjob(spec: JobSpec) -> Manifest:
    """The elastic ``PyTorchJob``: Workers only, rendezvous through the store Service."""
    elastic: dict[str, Any] = {
        "minReplicas": spec.nnodes.min,
        "maxReplicas": spec.nnodes.max,
        "rdzvBackend": spec.rdzv_backend,
        "rdzvHost": store_service_name(spec),
        "rdzvPort": store_port(spec),
        "rdzvId": spec.name,
        "maxRestarts": spec.max_restarts,
    }
    conf = worker_rdzv_conf(spec)
    if conf:
        elastic["rdzvConf"] = [{"key": k, "value": v} for k, v in conf]
    if spec.hpa_metrics:
        elastic["metrics"] = [dict(m) for m in spec.hpa_metrics]
    run_policy: dict[str, Any] = {"cleanPodPolicy": "None"}
    if spec.backoff_limit is not None:
        run_policy["backoffLimit"] = spec.backoff_limit
    if spec.scheduling.queue is not None:
        run_policy["suspend"] = True  # Kueue un-suspends it once the whole job is admitted
    container = worker_container(
        spec,
        name=CONTAINER_NAME,
        command=["flexrun", "run"],
        args=[*pod_flags(spec), *entrypoint(spec)],
    )
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": job_meta(spec),
        "spec": {
            "runPolicy": run_policy,
            "elasticPolicy": elastic,
            "nprocPerNode": spec.nproc_per_node,
            "pytorchReplicaSpecs": {
                "Worker": {
                    "replicas": spec.replicas,
                    "restartPolicy": "ExitCode",
                    "template": {
                        "metadata": worker_pod_metadata(spec),
                        "spec": worker_pod_spec(spec, container),
                    },
                }
            },
        },
    }


def render(spec: JobSpec) -> list[Manifest]:
    """Every object of the job, in the order ``kubectl apply`` should create them.

    The checkpoint PVC, the Secrets render creates (empty), the store, its
    NetworkPolicies, then the workers: a PyTorchJob, or (``target: trainjob``) the
    runtime and the TrainJob that references it.
    """
    if spec.target == TARGET_TRAINJOB:
        workers = trainjob.render_trainjob(spec)
    else:
        workers = [render_pytorchjob(spec)]
    return [fresh(m) for m in (*supporting_objects(spec), *workers)]


def to_yaml(manifests: list[Manifest]) -> str:
    """A multi-document YAML stream, keys in insertion order (stable for golden files)."""
    import yaml

    class _Dumper(yaml.SafeDumper):
        # A dict reused in two places (labels) must not become a YAML anchor/alias.
        def ignore_aliases(self, data: Any) -> bool:
            return True

    def numbers(dumper: yaml.SafeDumper, data: list[Any]) -> yaml.Node:
        # A list of numbers (a pod failure policy's exit codes) on a few lines, not 127.
        flow = len(data) > 1 and all(isinstance(v, int) and not isinstance(v, bool) for v in data)
        return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow or None)

    _Dumper.add_representer(list, numbers)
    return yaml.dump_all(
        manifests, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=100
    )


__all__ = [
    "AGENT_EXIT_MARGIN_S",
    "CONTAINER_NAME",
    "ETCD_CLIENT_PORT",
    "ETCD_IMAGE",
    "ETCD_MEMBERS",
    "ETCD_PEER_PORT",
    "Manifest",
    "labels",
    "render",
    "render_pytorchjob",
    "stop_grace_s",
    "store_port",
    "store_service_name",
    "to_yaml",
]
