"""The PyTorchJob checks flexrun needs, as a compact JSON Schema of its own.

Owns the structural rules for ``kubeflow.org/v1 PyTorchJob`` objects: the field names and
types of the CRD's ``openAPIV3Schema`` (Kubeflow trainer v1.9, the last release with
``elasticPolicy``), tightened with what the CRD leaves out: ``additionalProperties: false``
(the API server silently prunes unknown fields, so a typo would be lost, not rejected) and
the enums the operator documents but does not enforce. It is derived, not copied: no
descriptions, and nested Kubernetes types (affinity, volumes, probes ...) are left open
here and checked by ``kubernetes-validate`` when it is installed (see ``validate.py``).
Also owns the Kubeflow v1 admission-webhook rules that no schema can express
(:func:`webhook_problems`) and :func:`check_pytorchjob`, both together.

``tests/unit/k8s/test_k8s_shared_crd.py`` compares every property list below with the real
CRD when ``../shared/schemas`` is present, so a drift shows up as a failing test.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from flexrun.k8s.problems import Problem, draft7_problems

Schema = dict[str, Any]

REPLICA_TYPES = ("Master", "Worker")
RESTART_POLICIES = ("Always", "OnFailure", "Never", "ExitCode")
CLEAN_POD_POLICIES = ("All", "Running", "None")
#: The operator's documented backends (c10d, etcd, etcd-v2) plus flexrun's own names.
RDZV_BACKENDS = ("c10d", "etcd", "etcd-v2", "etcd-v3", "tcp")

_ANY: Schema = {}
_STR: Schema = {"type": "string"}
_BOOL: Schema = {"type": "boolean"}
_INT32: Schema = {"type": "integer", "minimum": -(2**31), "maximum": 2**31 - 1}
_INT64: Schema = {"type": "integer"}
_STR_MAP: Schema = {"type": "object", "additionalProperties": _STR}
_STR_LIST: Schema = {"type": "array", "items": _STR}
_OBJ: Schema = {"type": "object"}
_LIST_OF_OBJ: Schema = {"type": "array", "items": _OBJ}
_QUANTITY: Schema = {
    "anyOf": [{"type": "integer"}, {"type": "string"}],
    "pattern": r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$",
}


def _closed(properties: dict[str, Schema], required: tuple[str, ...] = ()) -> Schema:
    schema: Schema = {"type": "object", "properties": properties, "additionalProperties": False}
    if required:
        schema["required"] = list(required)
    return schema


def _enum(values: tuple[str, ...]) -> Schema:
    return {"type": "string", "enum": list(values)}


# Top-level ObjectMeta: the CRD says only "object"; the API server knows these fields.
OBJECT_META = _closed(
    {
        "name": _STR,
        "generateName": _STR,
        "namespace": _STR,
        "labels": _STR_MAP,
        "annotations": _STR_MAP,
        "finalizers": _STR_LIST,
        "ownerReferences": _LIST_OF_OBJ,
        "uid": _STR,
        "resourceVersion": _STR,
        "generation": _INT64,
        "creationTimestamp": {"type": ["string", "null"]},
        "deletionTimestamp": _STR,
        "deletionGracePeriodSeconds": _INT64,
        "managedFields": _LIST_OF_OBJ,
        "selfLink": _STR,
    }
)

TEMPLATE_META = _closed(
    {
        "name": _STR,
        "namespace": _STR,
        "labels": _STR_MAP,
        "annotations": _STR_MAP,
        "finalizers": _STR_LIST,
    }
)

_TOLERATION = _closed(
    {
        "key": _STR,
        "operator": _enum(("Equal", "Exists")),
        "value": _STR,
        "effect": _enum(("NoSchedule", "PreferNoSchedule", "NoExecute")),
        "tolerationSeconds": _INT64,
    }
)

_ENV_VAR = _closed({"name": _STR, "value": _STR, "valueFrom": _OBJ}, required=("name",))

_RESOURCES = _closed(
    {
        "claims": _LIST_OF_OBJ,
        "limits": {"type": "object", "additionalProperties": _QUANTITY},
        "requests": {"type": "object", "additionalProperties": _QUANTITY},
    }
)

CONTAINER = _closed(
    {
        "args": _STR_LIST,
        "command": _STR_LIST,
        "env": {"type": "array", "items": _ENV_VAR},
        "envFrom": _LIST_OF_OBJ,
        "image": _STR,
        "imagePullPolicy": _enum(("Always", "IfNotPresent", "Never")),
        "lifecycle": _OBJ,
        "livenessProbe": _OBJ,
        "name": _STR,
        "ports": _LIST_OF_OBJ,
        "readinessProbe": _OBJ,
        "resizePolicy": _LIST_OF_OBJ,
        "resources": _RESOURCES,
        "restartPolicy": _STR,
        "restartPolicyRules": _LIST_OF_OBJ,
        "securityContext": _OBJ,
        "startupProbe": _OBJ,
        "stdin": _BOOL,
        "stdinOnce": _BOOL,
        "terminationMessagePath": _STR,
        "terminationMessagePolicy": _STR,
        "tty": _BOOL,
        "volumeDevices": _LIST_OF_OBJ,
        "volumeMounts": _LIST_OF_OBJ,
        "workingDir": _STR,
    },
    required=("name",),
)

POD_SPEC = _closed(
    {
        "activeDeadlineSeconds": _INT64,
        "affinity": _OBJ,
        "automountServiceAccountToken": _BOOL,
        "containers": {"type": "array", "items": CONTAINER},
        "dnsConfig": _OBJ,
        "dnsPolicy": _STR,
        "enableServiceLinks": _BOOL,
        "ephemeralContainers": _LIST_OF_OBJ,
        "hostAliases": _LIST_OF_OBJ,
        "hostIPC": _BOOL,
        "hostNetwork": _BOOL,
        "hostPID": _BOOL,
        "hostUsers": _BOOL,
        "hostname": _STR,
        "hostnameOverride": _STR,
        "imagePullSecrets": _LIST_OF_OBJ,
        "initContainers": {"type": "array", "items": CONTAINER},
        "nodeName": _STR,
        "nodeSelector": _STR_MAP,
        "os": _OBJ,
        "overhead": {"type": "object", "additionalProperties": _QUANTITY},
        "preemptionPolicy": _STR,
        "priority": _INT32,
        "priorityClassName": _STR,
        "readinessGates": _LIST_OF_OBJ,
        "resourceClaims": _LIST_OF_OBJ,
        "resources": _OBJ,
        "restartPolicy": _STR,
        "runtimeClassName": _STR,
        "schedulerName": _STR,
        "schedulingGates": _LIST_OF_OBJ,
        "schedulingGroup": _OBJ,
        "securityContext": _OBJ,
        "serviceAccount": _STR,
        "serviceAccountName": _STR,
        "setHostnameAsFQDN": _BOOL,
        "shareProcessNamespace": _BOOL,
        "subdomain": _STR,
        "terminationGracePeriodSeconds": _INT64,
        "tolerations": {"type": "array", "items": _TOLERATION},
        "topologySpreadConstraints": _LIST_OF_OBJ,
        "volumes": {"type": "array", "items": {"type": "object", "required": ["name"]}},
    },
    required=("containers",),
)

REPLICA_SPEC = _closed(
    {
        "replicas": _INT32,
        "restartPolicy": _enum(RESTART_POLICIES),
        "template": _closed({"metadata": TEMPLATE_META, "spec": POD_SPEC}),
    }
)

SCHEDULING_POLICY = _closed(
    {
        "minAvailable": _INT32,
        "minResources": {"type": "object", "additionalProperties": _QUANTITY},
        "priorityClass": _STR,
        "queue": _STR,
        "scheduleTimeoutSeconds": _INT32,
    }
)

RUN_POLICY = _closed(
    {
        "activeDeadlineSeconds": _INT64,
        "backoffLimit": _INT32,
        "cleanPodPolicy": _enum(CLEAN_POD_POLICIES),
        "managedBy": _STR,
        "schedulingPolicy": SCHEDULING_POLICY,
        "suspend": _BOOL,
        "ttlSecondsAfterFinished": _INT32,
    }
)

ELASTIC_POLICY = _closed(
    {
        "maxReplicas": _INT32,
        "maxRestarts": _INT32,
        # autoscaling/v2 MetricSpec; its deep structure is the HPA's business.
        "metrics": {"type": "array", "items": {"type": "object", "required": ["type"]}},
        "minReplicas": _INT32,
        "nProcPerNode": _INT32,
        "rdzvBackend": _enum(RDZV_BACKENDS),
        "rdzvConf": {"type": "array", "items": _closed({"key": _STR, "value": _STR})},
        "rdzvHost": _STR,
        "rdzvId": _STR,
        "rdzvPort": {"type": "integer", "minimum": 1, "maximum": 65535},
        "standalone": _BOOL,
    }
)

PYTORCHJOB_SPEC = _closed(
    {
        "elasticPolicy": ELASTIC_POLICY,
        "nprocPerNode": {"type": "string", "pattern": r"^(auto|cpu|gpu|[1-9][0-9]*)$"},
        "pytorchReplicaSpecs": {
            # Replica types (Master/Worker) are a webhook rule, checked in validate.py.
            "type": "object",
            "additionalProperties": REPLICA_SPEC,
        },
        "runPolicy": RUN_POLICY,
    },
    required=("pytorchReplicaSpecs",),
)

PYTORCHJOB = _closed(
    {
        "apiVersion": {"const": "kubeflow.org/v1"},
        "kind": {"const": "PyTorchJob"},
        "metadata": OBJECT_META,
        "spec": PYTORCHJOB_SPEC,
        "status": _ANY,
    },
    required=("apiVersion", "kind", "metadata", "spec"),
)

#: Paths (in the CRD's openAPIV3Schema ``properties`` tree) whose property names the
#: schemas above mirror one for one; the drift test walks these.
MIRRORED: dict[tuple[str, ...], Schema] = {
    ("spec",): PYTORCHJOB_SPEC,
    ("spec", "runPolicy"): RUN_POLICY,
    ("spec", "runPolicy", "schedulingPolicy"): SCHEDULING_POLICY,
    ("spec", "elasticPolicy"): ELASTIC_POLICY,
    ("spec", "pytorchReplicaSpecs", "*"): REPLICA_SPEC,
    ("spec", "pytorchReplicaSpecs", "*", "template", "metadata"): TEMPLATE_META,
    ("spec", "pytorchReplicaSpecs", "*", "template", "spec"): POD_SPEC,
    ("spec", "pytorchReplicaSpecs", "*", "template", "spec", "containers", "[]"): CONTAINER,
}


# --- the webhook rules ---------------------------------------------------------------

_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
# (PET_RUN_DIR is flexrun's own setting, not the operator's: spec.runDir renders it.)
_OPERATOR_ENV = re.compile(r"^(PET_(?!RUN_DIR$)[A-Z_]+|MASTER_ADDR|MASTER_PORT|WORLD_SIZE|RANK)$")


def webhook_problems(obj: str, job: Mapping[str, Any]) -> list[Problem]:
    """The Kubeflow v1 admission webhook's rules, which the CRD schema cannot express."""
    out: list[Problem] = []

    def bad(path: str, message: str, error: bool = True) -> None:
        out.append(Problem(obj=obj, path=path, message=message, error=error))

    meta = job.get("metadata")
    name = meta.get("name") if isinstance(meta, Mapping) else None
    if not isinstance(name, str) or not _DNS1035.match(name) or len(name) > 63:
        bad("metadata.name", f"{name!r} must be a DNS-1035 label (the operator rejects it)")
    spec = job.get("spec")
    if not isinstance(spec, Mapping):
        return out
    replicas = spec.get("pytorchReplicaSpecs")
    if not isinstance(replicas, Mapping) or not replicas:
        bad("spec.pytorchReplicaSpecs", "must define at least a Worker replica spec")
        return out
    for rtype, rspec in replicas.items():
        base = f"spec.pytorchReplicaSpecs.{rtype}"
        if rtype not in REPLICA_TYPES:
            bad(base, f"replica type {rtype!r} not one of {', '.join(REPLICA_TYPES)}")
            continue
        if not isinstance(rspec, Mapping):
            bad(base, "must be a replica spec")
            continue
        count = rspec.get("replicas")
        if rtype == "Master" and count is not None and count != 1:
            bad(f"{base}.replicas", f"there must be exactly 1 Master replica (got {count})")
        if rtype == "Worker" and isinstance(count, int) and count < 1:
            bad(f"{base}.replicas", f"Worker needs at least 1 replica (got {count})")
        template = rspec.get("template")
        pod = template.get("spec") if isinstance(template, Mapping) else None
        containers = pod.get("containers") if isinstance(pod, Mapping) else None
        if not isinstance(containers, list) or not containers:
            bad(f"{base}.template.spec.containers", "containers definition expected")
            continue
        names = []
        for i, c in enumerate(containers):
            if not isinstance(c, Mapping):
                continue
            names.append(c.get("name"))
            if not c.get("image"):
                bad(f"{base}.template.spec.containers[{i}].image", "image is required")
            if c.get("name") == "pytorch":
                for j, env in enumerate(c.get("env") or []):
                    if isinstance(env, Mapping) and _OPERATOR_ENV.match(str(env.get("name"))):
                        bad(
                            f"{base}.template.spec.containers[{i}].env[{j}]",
                            f"{env.get('name')} is injected by the operator; set the job field instead",
                            error=False,
                        )
        if "pytorch" not in names:
            bad(
                f"{base}.template.spec.containers",
                f"no container named 'pytorch' (found {', '.join(map(str, names))})",
            )
    elastic = spec.get("elasticPolicy")
    if isinstance(elastic, Mapping):
        if "Worker" not in replicas:
            bad("spec.elasticPolicy", "requires a Worker replica spec")
        lo, hi = elastic.get("minReplicas"), elastic.get("maxReplicas")
        if isinstance(lo, int) and isinstance(hi, int) and lo > hi:
            bad("spec.elasticPolicy", f"minReplicas {lo} > maxReplicas {hi}")
        if isinstance(lo, int) and lo < 1:
            bad("spec.elasticPolicy.minReplicas", f"must be >= 1 (got {lo})")
        if elastic.get("nProcPerNode") is not None and spec.get("nprocPerNode") is not None:
            bad(
                "spec.elasticPolicy.nProcPerNode",
                "deprecated; cannot be set together with spec.nprocPerNode (use only the latter)",
            )
        worker = replicas.get("Worker")
        count = worker.get("replicas") if isinstance(worker, Mapping) else None
        if (
            isinstance(count, int)
            and isinstance(lo, int)
            and isinstance(hi, int)
            and lo <= hi
            and not lo <= count <= hi
        ):
            bad(
                "spec.pytorchReplicaSpecs.Worker.replicas",
                f"{count} outside elasticPolicy {lo}..{hi}",
            )
        policy = worker.get("restartPolicy") if isinstance(worker, Mapping) else None
        if policy in ("Never", "OnFailure", None):
            bad(
                "spec.pytorchReplicaSpecs.Worker.restartPolicy",
                f"{policy or 'unset'}: a preempted pod (exit 143) is not retried while a "
                "script bug may be; ExitCode retries only 128-255",
                error=False,
            )
    return out


def check_pytorchjob(obj: str, job: Mapping[str, Any]) -> list[Problem]:
    """Derived CRD schema + webhook rules for one ``PyTorchJob``."""
    return draft7_problems(obj, PYTORCHJOB, job) + webhook_problems(obj, job)
