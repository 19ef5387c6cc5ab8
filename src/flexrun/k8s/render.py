"""Job spec -> Kubernetes manifests (plain dicts) -> YAML.

Owns the shape of every object flexrun deploys: the ``PyTorchJob`` (``kubeflow.org/v1``,
elastic, Workers only), the rendezvous store (``flexrun store`` Deployment + Service, or a
3-member etcd StatefulSet + Services) and the checkpoint PVC. It does not parse or check
the user's spec (``spec.py``) nor validate manifests (``validate.py``); output is
deterministic so golden files can pin it.

Design choices an operator of the cluster should know:

- Workers run ``flexrun run <script>`` and nothing else: the Kubeflow operator injects the
  ``PET_*`` variables (nnodes, nproc, rendezvous backend/endpoint/id, max restarts) from
  ``elasticPolicy`` and ``spec.nprocPerNode``, and the launcher defaults every option from
  them, exactly as torchrun does.
- ``rdzvHost`` points at flexrun's own store Service. The operator's default endpoint is
  ``<job>-worker-0``, a spot pod: losing it would lose the rendezvous.
- The store pods never tolerate the spot taints and require the spot labels' absence
  (node affinity); etcd members also repel each other (pod anti-affinity per host).
- ``restartPolicy: ExitCode``: a preempted pod exits 143 (128 + SIGTERM) and the operator
  re-creates it; a script bug exits 1..127 and is not retried.
"""

from __future__ import annotations

from typing import Any

from flexrun.k8s.spec import JobSpec

ETCD_IMAGE = "quay.io/coreos/etcd:v3.5.17"
ETCD_MEMBERS = 3
ETCD_CLIENT_PORT = 2379
ETCD_PEER_PORT = 2380
CONTAINER_NAME = "pytorch"

Manifest = dict[str, Any]


def _labels(spec: JobSpec, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "flexrun",
        "app.kubernetes.io/instance": spec.name,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/managed-by": "flexrun",
    }


def _meta(spec: JobSpec, name: str, component: str) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if spec.namespace is not None:
        meta["namespace"] = spec.namespace
    meta["labels"] = _labels(spec, component)
    return meta


def store_service_name(spec: JobSpec) -> str:
    """DNS name (within the namespace) of the Service workers rendezvous through."""
    return f"{spec.name}-etcd" if spec.store.type == "etcd" else f"{spec.name}-store"


def store_port(spec: JobSpec) -> int:
    """Port of the store Service (the ``rdzvPort``)."""
    return ETCD_CLIENT_PORT if spec.store.type == "etcd" else spec.store.port


def _off_spot_affinity(spec: JobSpec) -> dict[str, Any]:
    expressions = [
        {"key": k, "operator": "NotIn", "values": [v]} for k, v in spec.spot.node_selector
    ]
    expressions += [
        {"key": k, "operator": "In", "values": [v]} for k, v in spec.store.node_selector
    ]
    if not expressions:
        return {}
    return {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": expressions}]
            }
        }
    }


#: Seconds of the pod's grace period kept back for the agent itself to exit after workers.
AGENT_EXIT_MARGIN_S = 10


def stop_grace_s(spec: JobSpec) -> int:
    """The agent's ``--stop-grace``: SIGTERM to SIGKILL for workers, inside the pod's grace."""
    return spec.grace_period_s - AGENT_EXIT_MARGIN_S


def _worker_container(spec: JobSpec) -> dict[str, Any]:
    # Only what the operator does not inject: this pod's address (the launcher's default,
    # 127.0.0.1, is unreachable from other pods) and a worker stop grace that fits inside
    # the pod's, so a final checkpoint is not cut short by the agent's own SIGKILL.
    args = ["--local-addr", "$(POD_IP)", "--stop-grace", str(stop_grace_s(spec))]
    args += ["-m", spec.module] if spec.module is not None else [str(spec.script)]
    args += list(spec.args)
    env: list[dict[str, Any]] = [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    ]
    env += [{"name": k, "value": v} for k, v in spec.env]
    if spec.checkpoint is not None:
        env.append({"name": "FLEXRUN_CHECKPOINT_DIR", "value": spec.checkpoint.mount_path})
    requests: dict[str, Any] = {}
    limits: dict[str, Any] = {}
    if spec.resources.cpu is not None:
        requests["cpu"] = spec.resources.cpu
    if spec.resources.memory is not None:
        requests["memory"] = limits["memory"] = spec.resources.memory
    if spec.resources.gpu:
        requests["nvidia.com/gpu"] = limits["nvidia.com/gpu"] = spec.resources.gpu
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": spec.image,
        "command": ["flexrun", "run"],
        "args": args,
    }
    container["env"] = env
    resources = {k: v for k, v in (("requests", requests), ("limits", limits)) if v}
    if resources:
        container["resources"] = resources
    mounts = []
    if spec.checkpoint is not None:
        mounts.append({"name": "checkpoints", "mountPath": spec.checkpoint.mount_path})
    if spec.shm_size is not None:
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    if mounts:
        container["volumeMounts"] = mounts
    return container


def _worker_pod_spec(spec: JobSpec) -> dict[str, Any]:
    pod: dict[str, Any] = {
        "terminationGracePeriodSeconds": spec.grace_period_s,
        "containers": [_worker_container(spec)],
    }
    if spec.spot.node_selector:
        pod["nodeSelector"] = dict(spec.spot.node_selector)
    if spec.spot.tolerations:
        pod["tolerations"] = [
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
    volumes: list[dict[str, Any]] = []
    if spec.checkpoint is not None:
        claim = spec.checkpoint.existing_claim or f"{spec.name}-checkpoints"
        volumes.append({"name": "checkpoints", "persistentVolumeClaim": {"claimName": claim}})
    if spec.shm_size is not None:
        volumes.append(
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.shm_size}}
        )
    if volumes:
        pod["volumes"] = volumes
    return pod


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
    if spec.rdzv_conf:
        elastic["rdzvConf"] = [{"key": k, "value": v} for k, v in spec.rdzv_conf]
    if spec.hpa_metrics:
        elastic["metrics"] = [dict(m) for m in spec.hpa_metrics]
    run_policy: dict[str, Any] = {"cleanPodPolicy": "None"}
    if spec.backoff_limit is not None:
        run_policy["backoffLimit"] = spec.backoff_limit
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": _meta(spec, spec.name, "job"),
        "spec": {
            "runPolicy": run_policy,
            "elasticPolicy": elastic,
            "nprocPerNode": spec.nproc_per_node,
            "pytorchReplicaSpecs": {
                "Worker": {
                    "replicas": spec.replicas,
                    "restartPolicy": "ExitCode",
                    "template": {
                        "metadata": {"labels": _labels(spec, "worker")},
                        "spec": _worker_pod_spec(spec),
                    },
                }
            },
        },
    }


def _tcp_store(spec: JobSpec) -> list[Manifest]:
    name = store_service_name(spec)
    labels = _labels(spec, "store")
    port = spec.store.port
    pod: dict[str, Any] = {
        "containers": [
            {
                "name": "store",
                "image": spec.store.image or spec.image,
                "command": ["flexrun", "store", "--host", "0.0.0.0", "--port", str(port)],
                "ports": [{"name": "store", "containerPort": port}],
                "readinessProbe": {"tcpSocket": {"port": "store"}, "periodSeconds": 5},
                "resources": {
                    "requests": {"cpu": "250m", "memory": "256Mi"},
                    "limits": {"memory": "1Gi"},
                },
            }
        ],
    }
    if affinity := _off_spot_affinity(spec):
        pod["affinity"] = affinity
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(spec, name, "store"),
        "spec": {
            "replicas": 1,
            # Two stores at once would split the job's state; replace, never overlap.
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": pod},
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(spec, name, "store"),
        "spec": {
            "selector": labels,
            "ports": [{"name": "store", "port": port, "targetPort": "store"}],
        },
    }
    return [deployment, service]


def _etcd_store(spec: JobSpec) -> list[Manifest]:
    name = store_service_name(spec)
    peers = f"{name}-peers"
    labels = _labels(spec, "etcd")
    members = [f"{name}-{i}" for i in range(ETCD_MEMBERS)]
    initial_cluster = ",".join(f"{m}=http://{m}.{peers}:{ETCD_PEER_PORT}" for m in members)
    command = [
        "etcd",
        "--name=$(POD_NAME)",
        "--data-dir=/var/lib/etcd",
        f"--listen-client-urls=http://0.0.0.0:{ETCD_CLIENT_PORT}",
        f"--advertise-client-urls=http://$(POD_NAME).{peers}:{ETCD_CLIENT_PORT}",
        f"--listen-peer-urls=http://0.0.0.0:{ETCD_PEER_PORT}",
        f"--initial-advertise-peer-urls=http://$(POD_NAME).{peers}:{ETCD_PEER_PORT}",
        f"--initial-cluster={initial_cluster}",
        f"--initial-cluster-token={spec.name}",
        "--initial-cluster-state=new",
    ]
    affinity = _off_spot_affinity(spec)
    affinity["podAntiAffinity"] = {
        # One member per host: a node failure costs one vote, never the quorum.
        "requiredDuringSchedulingIgnoredDuringExecution": [
            {"labelSelector": {"matchLabels": labels}, "topologyKey": "kubernetes.io/hostname"}
        ]
    }
    pod = {
        "affinity": affinity,
        "containers": [
            {
                "name": "etcd",
                "image": spec.store.image or ETCD_IMAGE,
                "command": command,
                "env": [
                    {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}
                ],
                "ports": [
                    {"name": "client", "containerPort": ETCD_CLIENT_PORT},
                    {"name": "peer", "containerPort": ETCD_PEER_PORT},
                ],
                "readinessProbe": {"tcpSocket": {"port": "client"}, "periodSeconds": 5},
                "resources": {
                    "requests": {"cpu": "250m", "memory": "512Mi"},
                    "limits": {"memory": "2Gi"},
                },
                "volumeMounts": [{"name": "data", "mountPath": "/var/lib/etcd"}],
            }
        ],
    }
    statefulset = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _meta(spec, name, "etcd"),
        "spec": {
            "serviceName": peers,
            "replicas": ETCD_MEMBERS,
            # Members must start together to bootstrap the initial cluster.
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": pod},
            "volumeClaimTemplates": [
                {
                    "metadata": {"name": "data"},
                    "spec": {
                        "accessModes": ["ReadWriteOnce"],
                        "resources": {"requests": {"storage": "1Gi"}},
                    },
                }
            ],
        },
    }
    peer_service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(spec, peers, "etcd"),
        "spec": {
            "clusterIP": "None",
            # Peers must resolve each other before they are ready, or bootstrap deadlocks.
            "publishNotReadyAddresses": True,
            "selector": labels,
            "ports": [
                {"name": "client", "port": ETCD_CLIENT_PORT},
                {"name": "peer", "port": ETCD_PEER_PORT},
            ],
        },
    }
    client_service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(spec, name, "etcd"),
        "spec": {
            "selector": labels,
            "ports": [{"name": "client", "port": ETCD_CLIENT_PORT, "targetPort": "client"}],
        },
    }
    return [statefulset, peer_service, client_service]


def _checkpoint_pvc(spec: JobSpec) -> list[Manifest]:
    ckpt = spec.checkpoint
    if ckpt is None or ckpt.existing_claim is not None:
        return []
    pvc_spec: dict[str, Any] = {
        "accessModes": [ckpt.access_mode],
        "resources": {"requests": {"storage": ckpt.size}},
    }
    if ckpt.storage_class is not None:
        pvc_spec["storageClassName"] = ckpt.storage_class
    return [
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": _meta(spec, f"{spec.name}-checkpoints", "checkpoints"),
            "spec": pvc_spec,
        }
    ]


def render(spec: JobSpec) -> list[Manifest]:
    """Every object of the job, in the order ``kubectl apply`` should create them."""
    store = _etcd_store(spec) if spec.store.type == "etcd" else _tcp_store(spec)
    return [_fresh(m) for m in (*_checkpoint_pvc(spec), *store, render_pytorchjob(spec))]


def _fresh(value: Any) -> Any:
    # Builders reuse dicts (the labels of a selector and its pods); callers that edit one
    # manifest must not silently edit another place. deepcopy would keep the sharing.
    if isinstance(value, dict):
        return {k: _fresh(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_fresh(v) for v in value]
    return value


def to_yaml(manifests: list[Manifest]) -> str:
    """A multi-document YAML stream, keys in insertion order (stable for golden files)."""
    import yaml

    class _Dumper(yaml.SafeDumper):
        # A dict reused in two places (labels) must not become a YAML anchor/alias.
        def ignore_aliases(self, data: Any) -> bool:
            return True

    return yaml.dump_all(
        manifests, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=100
    )
