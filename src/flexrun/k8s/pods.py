"""The worker pod: what every flexrun agent pod looks like, whichever operator creates it.

Owns the worker container (image, the ``flexrun run`` flags render always passes, its
environment, mounts and ports) and the pod around it (grace period, spot placement,
volumes, security context), shared by the PyTorchJob (``render.py``) and the TrainJob
runtime (``trainjob.py``). The targets differ only in the container's name, in which
launcher flags come from the operator's ``PET_*`` variables, and in the pod's restart
policy; those are arguments here.

The contract a rendered pod relies on (docs/user/kubernetes.md lists it too):

- ``flexrun run ... --local-addr $(POD_IP) --stop-grace <grace - 10>``, plus
  ``--metrics-port P --metrics-host 0.0.0.0`` only when ``spec.metrics.port`` is set;
- env ``POD_IP`` (downward API), ``FLEXRUN_JOB_SECRET_FILE=/var/run/flexrun/secret/secret``,
  ``FLEXRUN_CHECKPOINT_DIR`` (the volume's mount path, or a ``checkpoint.url``),
  ``FLEXRUN_CHECKPOINT_STORAGE_OPTIONS`` (compact JSON, sorted keys; only with
  ``checkpoint.storageOptions``), the spec's ``env`` and ``envFrom`` (by reference);
- mounts: the job Secret at ``/var/run/flexrun/secret`` and (etcd) the etcd Secret at
  ``/var/run/flexrun/etcd``, read-only, mode 0440, group = the pod's ``fsGroup`` (so a
  non-root user can read them); the checkpoint PVC (none for a ``url``); ``/dev/shm``;
- ``serviceAccountName`` when the spec names one (an object store's pod identity).
"""

from __future__ import annotations

from typing import Any

from flexrun.k8s.objects import POD_IP_ENV, etcd_secret_volume, fresh, labels, worker_selector
from flexrun.k8s.spec import JobSpec
from flexrun.k8s.spec_placement import RUNS_VOLUME
from flexrun.k8s.spec_types import (
    ETCD_SECRET_DIR,
    JOB_SECRET_DIR,
    JOB_SECRET_FILE,
    JOB_SECRET_KEY,
)
from flexrun.storage_options import CHECKPOINT_DIR_ENV, STORAGE_OPTIONS_ENV, storage_options_json

#: Seconds of the pod's grace period kept back for the agent itself to exit after workers.
AGENT_EXIT_MARGIN_S = 10
#: The pod's fsGroup: the Dockerfile's user id. Kubernetes adds it to the container's
#: groups and makes it the group of the Secret files (mode 0440), whatever user runs.
POD_FS_GROUP = 10001


def stop_grace_s(spec: JobSpec) -> int:
    """The agent's ``--stop-grace``: SIGTERM to SIGKILL for workers, inside the pod's grace."""
    return spec.grace_period_s - AGENT_EXIT_MARGIN_S


def pod_flags(spec: JobSpec) -> list[str]:
    """Flags no operator injects: this pod's address (the launcher's default, 127.0.0.1, is
    unreachable from other pods), a worker stop grace that fits inside the pod's, so a final
    checkpoint is not cut short by the agent's own SIGKILL, and the metrics endpoint."""
    flags = ["--local-addr", "$(POD_IP)", "--stop-grace", str(stop_grace_s(spec))]
    if spec.metrics_port is not None:
        flags += ["--metrics-port", str(spec.metrics_port), "--metrics-host", "0.0.0.0"]
    return flags


def entrypoint(spec: JobSpec) -> list[str]:
    """The script (or ``-m module``) and its arguments: the end of ``flexrun run``'s argv."""
    head = ["-m", spec.module] if spec.module is not None else [str(spec.script)]
    return [*head, *spec.args]


def run_dir_path(spec: JobSpec) -> str | None:
    """Each pod's ``PET_RUN_DIR`` on the durable volume (``$(POD_NAME)`` expanded by
    Kubernetes), or None when run directories stay in the pod."""
    rd = spec.run_dir
    if rd is None:
        return None
    if rd.existing_claim is not None:
        base = rd.mount_path.rstrip("/")
    else:
        assert spec.checkpoint is not None  # (JobSpec checked it)
        base = f"{spec.checkpoint.mount_path.rstrip('/')}/runs"
    return f"{base}/{spec.name}/$(POD_NAME)"


def resources(spec: JobSpec) -> dict[str, Any]:
    """Container resources: ``{requests, limits}``, empty parts dropped."""
    requests: dict[str, Any] = {}
    limits: dict[str, Any] = {}
    if spec.resources.cpu is not None:
        requests["cpu"] = spec.resources.cpu
    if spec.resources.memory is not None:
        requests["memory"] = limits["memory"] = spec.resources.memory
    if spec.resources.gpu:
        requests["nvidia.com/gpu"] = limits["nvidia.com/gpu"] = spec.resources.gpu
    if spec.network.rdma_resource is not None:
        rdma = spec.network.rdma_resource
        requests[rdma] = limits[rdma] = spec.network.rdma_count
    return {k: v for k, v in (("requests", requests), ("limits", limits)) if v}


def worker_container(
    spec: JobSpec,
    *,
    name: str,
    command: list[str],
    args: list[str] | None,
    with_resources: bool = True,
) -> dict[str, Any]:
    """The agent container; ``args`` None leaves them to the operator (a TrainJob's)."""
    env: list[dict[str, Any]] = [POD_IP_ENV]
    env += [{"name": k, "value": v} for k, v in spec.env]
    own = {k for k, _ in spec.env}
    if (run_dir := run_dir_path(spec)) is not None:
        env.append({"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}})
        env.append({"name": "PET_RUN_DIR", "value": run_dir})  # after POD_NAME: it expands
    env += [{"name": k, "value": v} for k, v in spec.network.nccl_env() if k not in own]
    env.append({"name": "FLEXRUN_JOB_SECRET_FILE", "value": JOB_SECRET_FILE})
    ckpt = spec.checkpoint
    if ckpt is not None:
        env.append({"name": CHECKPOINT_DIR_ENV, "value": ckpt.location})
        if ckpt.storage_options:
            env.append(
                {"name": STORAGE_OPTIONS_ENV, "value": storage_options_json(ckpt.storage_options)}
            )
    container: dict[str, Any] = {"name": name, "image": spec.image, "command": command}
    if args is not None:
        container["args"] = args
    container["env"] = env
    if spec.env_from:
        container["envFrom"] = [fresh(dict(source)) for source in spec.env_from]
    if with_resources and (res := resources(spec)):
        container["resources"] = res
    if spec.metrics_port is not None:
        container["ports"] = [{"name": "metrics", "containerPort": spec.metrics_port}]
    mounts: list[dict[str, Any]] = []
    if ckpt is not None and ckpt.has_volume:
        mounts.append({"name": "checkpoints", "mountPath": ckpt.mount_path})
    if spec.shm_size is not None:
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    if spec.run_dir is not None and spec.run_dir.existing_claim is not None:
        mounts.append({"name": RUNS_VOLUME, "mountPath": spec.run_dir.mount_path})
    mounts.append({"name": "job-secret", "mountPath": JOB_SECRET_DIR, "readOnly": True})
    if spec.store.type == "etcd":
        mounts.append({"name": "etcd-tls", "mountPath": ETCD_SECRET_DIR, "readOnly": True})
    container["volumeMounts"] = mounts
    return container


def _tolerations(spec: JobSpec) -> list[dict[str, Any]]:
    return [
        {
            k: v
            for k, v in (
                ("key", t.key),
                ("operator", t.operator),
                ("value", t.value),
                ("effect", t.effect),
                ("tolerationSeconds", t.toleration_seconds),
            )
            if v is not None
        }
        for t in spec.spot.tolerations
    ]


def _volumes(spec: JobSpec) -> list[dict[str, Any]]:
    volumes: list[dict[str, Any]] = []
    if spec.checkpoint is not None and spec.checkpoint.has_volume:
        claim = spec.checkpoint.existing_claim or f"{spec.name}-checkpoints"
        volumes.append({"name": "checkpoints", "persistentVolumeClaim": {"claimName": claim}})
    if spec.shm_size is not None:
        volumes.append(
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.shm_size}}
        )
    if spec.run_dir is not None and spec.run_dir.existing_claim is not None:
        volumes.append(
            {
                "name": RUNS_VOLUME,
                "persistentVolumeClaim": {"claimName": spec.run_dir.existing_claim},
            }
        )
    volumes.append(
        {
            "name": "job-secret",
            "secret": {
                "secretName": spec.job_secret_name,
                # An explicit item: a pod whose Secret lacks the key does not start.
                "items": [{"key": JOB_SECRET_KEY, "path": JOB_SECRET_KEY}],
                "defaultMode": 0o440,
            },
        }
    )
    if spec.store.type == "etcd":
        volumes.append(etcd_secret_volume(spec))
    return volumes


def worker_pod_spec(
    spec: JobSpec, container: dict[str, Any], *, restart_policy: str | None = None
) -> dict[str, Any]:
    """The pod around the agent container: grace, placement, volumes, security context."""
    pod: dict[str, Any] = {}
    if restart_policy is not None:
        pod["restartPolicy"] = restart_policy
    pod["terminationGracePeriodSeconds"] = spec.grace_period_s
    # fsGroup makes the Secret files readable by any user the image runs as; the policy
    # avoids a recursive chown of a large checkpoint volume at every start.
    pod["securityContext"] = {"fsGroup": POD_FS_GROUP, "fsGroupChangePolicy": "OnRootMismatch"}
    if spec.service_account is not None:
        pod["serviceAccountName"] = spec.service_account
    sched = spec.scheduling
    if sched.priority_class is not None:
        pod["priorityClassName"] = sched.priority_class
    if spec.network.host_network:
        pod["hostNetwork"] = True
        pod["dnsPolicy"] = "ClusterFirstWithHostNet"  # Services still resolve (the store)
    pod["containers"] = [container]
    if selector := {**dict(spec.spot.node_selector), **dict(sched.node_selector)}:
        pod["nodeSelector"] = selector
    if tolerations := [*_tolerations(spec), *(fresh(dict(t)) for t in sched.tolerations)]:
        pod["tolerations"] = tolerations
    if affinity := _affinity(spec):
        pod["affinity"] = affinity
    if spread := _spread(spec):
        pod["topologySpreadConstraints"] = spread
    pod["volumes"] = _volumes(spec)
    return pod


def _affinity(spec: JobSpec) -> dict[str, Any]:
    affinity: dict[str, Any] = fresh(dict(spec.scheduling.affinity or {}))
    if spec.scheduling.one_pod_per_node:
        anti = affinity.setdefault("podAntiAffinity", {})
        anti.setdefault("requiredDuringSchedulingIgnoredDuringExecution", []).append(
            {
                "labelSelector": {"matchLabels": worker_selector(spec)},
                "topologyKey": "kubernetes.io/hostname",
            }
        )
    return affinity


def _spread(spec: JobSpec) -> list[dict[str, Any]]:
    spread = [fresh(dict(c)) for c in spec.scheduling.topology_spread]
    if spec.scheduling.spread_zones:
        spread.append(
            {
                "maxSkew": 1,
                "topologyKey": "topology.kubernetes.io/zone",
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": worker_selector(spec)},
            }
        )
    return spread


def worker_pod_metadata(spec: JobSpec) -> dict[str, Any]:
    """The worker pods' labels (NetworkPolicies select them) and scrape annotations."""
    out: dict[str, Any] = {"labels": labels(spec, "worker")}
    if spec.metrics_port is not None:
        out["annotations"] = {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": str(spec.metrics_port),
        }
    return out
