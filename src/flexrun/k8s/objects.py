"""The job's supporting objects: rendezvous store, Secrets, NetworkPolicies, checkpoint PVC.

Owns the shape of everything a job needs besides its workers (``render.py`` has the
PyTorchJob, ``trainjob.py`` the TrainJob and its runtime, ``pods.py`` the worker pods),
and the label/metadata conventions they all share. Plain dicts in, plain dicts out;
deterministic, so golden files pin it.

Security choices an operator of the cluster should know (issue 18):

- **No secret value is ever rendered.** The job Secret (``<job>-secret``, key ``secret``)
  and etcd's (``<job>-etcd``: ``ca.crt``, ``tls.crt``, ``tls.key``) are emitted without
  ``data`` or ``type``, with an annotation saying how to fill them (``kubectl create
  secret generic ...``, before ``kubectl apply``: applying a data-less object never removes
  data it did not add), or are only referenced (``existingSecret``).
- **etcd speaks TLS only and requires a client certificate** signed by the job's CA, for
  clients and peers alike (``--client-cert-auth``, ``--peer-client-cert-auth``): a pod
  without the Secret cannot connect, read or write. It listens on its pod IP only.
- **NetworkPolicies** admit only the job's worker pods (by label) to the store port, and
  to etcd's client port; etcd members also reach each other on both ports. The kubelet's
  probes come from the node, which NetworkPolicy always allows.
- ``flexrun store`` is told to listen on its pod IP (torch's server may bind every
  interface regardless; the NetworkPolicy is what limits who reaches it).
"""

from __future__ import annotations

from typing import Any

from flexrun.k8s.spec import JobSpec
from flexrun.k8s.spec_placement import KUEUE_QUEUE_LABEL
from flexrun.k8s.spec_types import (
    ETCD_SECRET_DIR,
    ETCD_SECRET_KEYS,
    JOB_SECRET_KEY,
)

ETCD_IMAGE = "quay.io/coreos/etcd:v3.5.17"
ETCD_MEMBERS = 3
ETCD_CLIENT_PORT = 2379
ETCD_PEER_PORT = 2380

Manifest = dict[str, Any]

POD_IP_ENV: dict[str, Any] = {
    "name": "POD_IP",
    "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
}


def labels(spec: JobSpec, component: str) -> dict[str, str]:
    """The labels of every object (and pod) of ``component`` in this job."""
    return {
        "app.kubernetes.io/name": "flexrun",
        "app.kubernetes.io/instance": spec.name,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/managed-by": "flexrun",
    }


def meta(spec: JobSpec, name: str, component: str, *, namespaced: bool = True) -> dict[str, Any]:
    """``metadata`` of a top-level object (cluster-scoped ones take no namespace)."""
    out: dict[str, Any] = {"name": name}
    if namespaced and spec.namespace is not None:
        out["namespace"] = spec.namespace
    out["labels"] = labels(spec, component)
    return out


def job_meta(spec: JobSpec) -> dict[str, Any]:
    """``metadata`` of the job object itself (PyTorchJob or TrainJob): a Kueue queue label
    when the job goes through Kueue."""
    out = meta(spec, spec.name, "job")
    if spec.scheduling.queue is not None:
        out["labels"][KUEUE_QUEUE_LABEL] = spec.scheduling.queue
    return out


def worker_selector(spec: JobSpec) -> dict[str, str]:
    """Labels every worker pod carries (both targets): NetworkPolicies admit these."""
    return {
        "app.kubernetes.io/instance": spec.name,
        "app.kubernetes.io/component": "worker",
    }


def store_service_name(spec: JobSpec) -> str:
    """DNS name (within the namespace) of the Service workers rendezvous through."""
    return f"{spec.name}-etcd" if spec.store.type == "etcd" else f"{spec.name}-store"


def store_port(spec: JobSpec) -> int:
    """Port of the store Service (the ``rdzvPort``)."""
    return ETCD_CLIENT_PORT if spec.store.type == "etcd" else spec.store.port


def worker_rdzv_conf(spec: JobSpec) -> list[tuple[str, str]]:
    """Every ``--rdzv-conf`` entry of a worker pod: the spec's, etcd's TLS files, and for the
    tcp store ``is_host=false`` (the store runs in its own Deployment: an agent never hosts
    it, even where the Service's address looks like its own, e.g. with ``hostNetwork``)."""
    conf = [*spec.rdzv_conf, *etcd_client_conf(spec)]
    if spec.store.type != "etcd" and not any(k == "is_host" for k, _ in conf):
        conf.append(("is_host", "false"))
    return conf


def etcd_client_conf(spec: JobSpec) -> list[tuple[str, str]]:
    """``--rdzv-conf`` entries a worker needs for etcd's TLS (paths of the mounted Secret)."""
    if spec.store.type != "etcd":
        return []
    ca, cert, key = (f"{ETCD_SECRET_DIR}/{k}" for k in ETCD_SECRET_KEYS)
    return [("cacert", ca), ("cert", cert), ("key", key)]


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


# -- the rendezvous store ---------------------------------------------------------------


def tcp_store(spec: JobSpec) -> list[Manifest]:
    """A ``flexrun store`` Deployment (one pod, never two at once) and its Service."""
    name = store_service_name(spec)
    store_labels = labels(spec, "store")
    port = spec.store.port
    pod: dict[str, Any] = {
        "containers": [
            {
                "name": "store",
                "image": spec.store.image or spec.image,
                "command": ["flexrun", "store", "--host", "$(POD_IP)", "--port", str(port)],
                "env": [POD_IP_ENV],
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
        "metadata": meta(spec, name, "store"),
        "spec": {
            "replicas": 1,
            # Two stores at once would split the job's state; replace, never overlap.
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": store_labels},
            "template": {"metadata": {"labels": store_labels}, "spec": pod},
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta(spec, name, "store"),
        "spec": {
            "selector": store_labels,
            "ports": [{"name": "store", "port": port, "targetPort": "store"}],
        },
    }
    return [deployment, service]


def etcd_command(spec: JobSpec) -> list[str]:
    """The etcd member's command line: TLS with client certificates for clients and peers."""
    name = store_service_name(spec)
    peers = f"{name}-peers"
    members = [f"{name}-{i}" for i in range(ETCD_MEMBERS)]
    initial_cluster = ",".join(f"{m}=https://{m}.{peers}:{ETCD_PEER_PORT}" for m in members)
    ca, cert, key = (f"{ETCD_SECRET_DIR}/{k}" for k in ETCD_SECRET_KEYS)
    return [
        "etcd",
        "--name=$(POD_NAME)",
        "--data-dir=/var/lib/etcd",
        f"--listen-client-urls=https://$(POD_IP):{ETCD_CLIENT_PORT}",
        f"--advertise-client-urls=https://$(POD_NAME).{peers}:{ETCD_CLIENT_PORT}",
        f"--listen-peer-urls=https://$(POD_IP):{ETCD_PEER_PORT}",
        f"--initial-advertise-peer-urls=https://$(POD_NAME).{peers}:{ETCD_PEER_PORT}",
        f"--initial-cluster={initial_cluster}",
        f"--initial-cluster-token={spec.name}",
        "--initial-cluster-state=new",
        "--client-cert-auth",
        f"--trusted-ca-file={ca}",
        f"--cert-file={cert}",
        f"--key-file={key}",
        "--peer-client-cert-auth",
        f"--peer-trusted-ca-file={ca}",
        f"--peer-cert-file={cert}",
        f"--peer-key-file={key}",
    ]


def etcd_secret_volume(spec: JobSpec) -> dict[str, Any]:
    """The etcd Secret as a read-only volume (group-readable for a non-root fsGroup)."""
    return {
        "name": "etcd-tls",
        "secret": {
            "secretName": spec.etcd_secret_name,
            "items": [{"key": k, "path": k} for k in ETCD_SECRET_KEYS],
            "defaultMode": 0o440,
        },
    }


def etcd_store(spec: JobSpec) -> list[Manifest]:
    """A 3-member etcd StatefulSet (one member per host), its peer and client Services."""
    name = store_service_name(spec)
    peers = f"{name}-peers"
    etcd_labels = labels(spec, "etcd")
    affinity = _off_spot_affinity(spec)
    affinity["podAntiAffinity"] = {
        # One member per host: a node failure costs one vote, never the quorum.
        "requiredDuringSchedulingIgnoredDuringExecution": [
            {"labelSelector": {"matchLabels": etcd_labels}, "topologyKey": "kubernetes.io/hostname"}
        ]
    }
    pod = {
        "affinity": affinity,
        "containers": [
            {
                "name": "etcd",
                "image": spec.store.image or ETCD_IMAGE,
                "command": etcd_command(spec),
                "env": [
                    {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                    POD_IP_ENV,
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
                "volumeMounts": [
                    {"name": "data", "mountPath": "/var/lib/etcd"},
                    {"name": "etcd-tls", "mountPath": ETCD_SECRET_DIR, "readOnly": True},
                ],
            }
        ],
        "volumes": [etcd_secret_volume(spec)],
    }
    statefulset = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": meta(spec, name, "etcd"),
        "spec": {
            "serviceName": peers,
            "replicas": ETCD_MEMBERS,
            # Members must start together to bootstrap the initial cluster.
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": etcd_labels},
            "template": {"metadata": {"labels": etcd_labels}, "spec": pod},
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
        "metadata": meta(spec, peers, "etcd"),
        "spec": {
            "clusterIP": "None",
            # Peers must resolve each other before they are ready, or bootstrap deadlocks.
            "publishNotReadyAddresses": True,
            "selector": etcd_labels,
            "ports": [
                {"name": "client", "port": ETCD_CLIENT_PORT},
                {"name": "peer", "port": ETCD_PEER_PORT},
            ],
        },
    }
    client_service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta(spec, name, "etcd"),
        "spec": {
            "selector": etcd_labels,
            "ports": [{"name": "client", "port": ETCD_CLIENT_PORT, "targetPort": "client"}],
        },
    }
    return [statefulset, peer_service, client_service]


def store_objects(spec: JobSpec) -> list[Manifest]:
    return etcd_store(spec) if spec.store.type == "etcd" else tcp_store(spec)


# -- secrets, network policy, checkpoints --------------------------------------------------


def _placeholder_secret(spec: JobSpec, name: str, how: str) -> Manifest:
    # No data and no type: `kubectl apply` of this object never changes a Secret that was
    # created (with its values) by `kubectl create secret` or by cert-manager.
    m = meta(spec, name, "secret")
    m["annotations"] = {"flexrun.dev/values": how}
    return {"apiVersion": "v1", "kind": "Secret", "metadata": m}


def secrets(spec: JobSpec) -> list[Manifest]:
    """The Secrets the job mounts that render creates (empty: values are never rendered)."""
    ns = f" -n {spec.namespace}" if spec.namespace else ""
    out = []
    if spec.existing_job_secret is None:
        out.append(
            _placeholder_secret(
                spec,
                spec.job_secret_name,
                f"create before kubectl apply: kubectl create secret generic "
                f"{spec.job_secret_name}{ns} --from-literal={JOB_SECRET_KEY}=$(openssl rand "
                "-hex 32); it authenticates the job's rendezvous records",
            )
        )
    if spec.store.type == "etcd" and spec.store.existing_secret is None:
        files = " ".join(f"--from-file={k}" for k in ETCD_SECRET_KEYS)
        out.append(
            _placeholder_secret(
                spec,
                spec.etcd_secret_name,
                f"create before kubectl apply: kubectl create secret generic "
                f"{spec.etcd_secret_name}{ns} {files} (the job's etcd CA, and a certificate "
                "for clients and peers; see the README)",
            )
        )
    return out


def _port_rule(ports: list[int], selectors: list[dict[str, str]]) -> dict[str, Any]:
    return {
        "from": [{"podSelector": {"matchLabels": s}} for s in selectors],
        "ports": [{"protocol": "TCP", "port": p} for p in ports],
    }


def network_policies(spec: JobSpec) -> list[Manifest]:
    """Ingress to the store (and etcd) from this job's worker pods only."""
    if not spec.network_policy:
        return []
    if spec.store.type == "etcd":
        etcd = labels(spec, "etcd")
        name, target = f"{spec.name}-etcd", etcd
        ingress = [
            _port_rule([ETCD_CLIENT_PORT], [worker_selector(spec)]),
            _port_rule([ETCD_CLIENT_PORT, ETCD_PEER_PORT], [etcd]),
        ]
    else:
        name, target = f"{spec.name}-store", labels(spec, "store")
        ingress = [_port_rule([spec.store.port], [worker_selector(spec)])]
    return [
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": meta(spec, name, "network-policy"),
            "spec": {
                "podSelector": {"matchLabels": target},
                "policyTypes": ["Ingress"],
                "ingress": ingress,
            },
        }
    ]


def checkpoint_pvc(spec: JobSpec) -> list[Manifest]:
    ckpt = spec.checkpoint
    if ckpt is None or not ckpt.has_volume or ckpt.existing_claim is not None:
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
            "metadata": meta(spec, f"{spec.name}-checkpoints", "checkpoints"),
            "spec": pvc_spec,
        }
    ]


def supporting_objects(spec: JobSpec) -> list[Manifest]:
    """Everything before the workers, in the order ``kubectl apply`` should create it."""
    return [*checkpoint_pvc(spec), *secrets(spec), *store_objects(spec), *network_policies(spec)]


def fresh(value: Any) -> Any:
    """A copy with no dict or list shared between places (builders reuse label dicts)."""
    # Callers that edit one manifest must not silently edit another; deepcopy would keep
    # the sharing.
    if isinstance(value, dict):
        return {k: fresh(v) for k, v in value.items()}
    if isinstance(value, list):
        return [fresh(v) for v in value]
    return value
