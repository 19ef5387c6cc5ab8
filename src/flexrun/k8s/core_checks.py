"""Checks of core Kubernetes objects: flexrun's structural rules, and Kubernetes' schemas.

Owns what ``flexrun k8s validate`` says about Deployments, StatefulSets, Services, PVCs,
Secrets and NetworkPolicies without any optional package (selectors that match their
pods, containers with images, ports in range, storage requests, secret values in a
manifest, policy types), and the bridge to ``kubernetes-validate`` (Kubernetes' own
OpenAPI schemas, shipped with it, so offline) for any core object or an embedded pod or
job template. It does not know Kubeflow's kinds (``_pytorchjob_rules``,
``validate_trainer``).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from flexrun.k8s.problems import Problem, dotted

KUBERNETES_VALIDATE_REQUIREMENT = "kubernetes-validate>=1.28"
_ACCESS_MODES = ("ReadWriteOnce", "ReadWriteMany", "ReadWriteOncePod", "ReadOnlyMany")
_POLICY_TYPES = ("Ingress", "Egress")


def _m(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def containers_problems(obj: str, base: str, pod: object) -> list[Problem]:
    """Every container of a pod spec has a name and an image."""
    out = []
    containers = pod.get("containers") if isinstance(pod, Mapping) else None
    if not isinstance(containers, list) or not containers:
        return [
            Problem(obj=obj, path=f"{base}.containers", message="at least one container required")
        ]
    for i, c in enumerate(containers):
        if not isinstance(c, Mapping):
            out.append(
                Problem(obj=obj, path=f"{base}.containers[{i}]", message="must be a mapping")
            )
            continue
        for key in ("name", "image"):
            if not isinstance(c.get(key), str) or not c.get(key):
                out.append(
                    Problem(obj=obj, path=f"{base}.containers[{i}].{key}", message="is required")
                )
    return out


def _workload_problems(obj: str, doc: Mapping[str, Any]) -> list[Problem]:
    spec = doc.get("spec")
    if not isinstance(spec, Mapping):
        return [Problem(obj=obj, path="spec", message="is required")]
    out = []
    template = spec.get("template")
    if not isinstance(template, Mapping):
        return [Problem(obj=obj, path="spec.template", message="is required")]
    pod_labels = _m(_m(template.get("metadata")).get("labels"))
    selector = _m(spec.get("selector")).get("matchLabels")
    if not isinstance(selector, Mapping) or not selector:
        out.append(Problem(obj=obj, path="spec.selector.matchLabels", message="is required"))
    else:
        for k, v in selector.items():
            if pod_labels.get(k) != v:
                out.append(
                    Problem(
                        obj=obj,
                        path="spec.template.metadata.labels",
                        message=f"does not match selector {k}={v} (the controller would own no pods)",
                    )
                )
    if doc.get("kind") == "StatefulSet" and not spec.get("serviceName"):
        out.append(
            Problem(obj=obj, path="spec.serviceName", message="is required for stable pod DNS")
        )
    out += containers_problems(obj, "spec.template.spec", template.get("spec"))
    return out


def _bad_port(value: object) -> bool:
    return isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535


def _service_problems(obj: str, doc: Mapping[str, Any]) -> list[Problem]:
    spec = doc.get("spec")
    if not isinstance(spec, Mapping):
        return [Problem(obj=obj, path="spec", message="is required")]
    ports = spec.get("ports")
    if not isinstance(ports, list) or not ports:
        return [Problem(obj=obj, path="spec.ports", message="at least one port required")]
    out = []
    for i, p in enumerate(ports):
        port = p.get("port") if isinstance(p, Mapping) else None
        if _bad_port(port):
            out.append(
                Problem(obj=obj, path=f"spec.ports[{i}].port", message=f"{port!r} is not 1..65535")
            )
    return out


def _pvc_problems(obj: str, doc: Mapping[str, Any]) -> list[Problem]:
    spec = doc.get("spec")
    if not isinstance(spec, Mapping):
        return [Problem(obj=obj, path="spec", message="is required")]
    out = []
    modes = spec.get("accessModes")
    if not isinstance(modes, list) or not modes:
        out.append(Problem(obj=obj, path="spec.accessModes", message="at least one required"))
    else:
        for i, m in enumerate(modes):
            if m not in _ACCESS_MODES:
                out.append(
                    Problem(
                        obj=obj,
                        path=f"spec.accessModes[{i}]",
                        message=f"{m!r} not one of {', '.join(_ACCESS_MODES)}",
                    )
                )
    storage = _m(_m(spec.get("resources")).get("requests")).get("storage")
    if storage is None and not spec.get("volumeName"):
        out.append(Problem(obj=obj, path="spec.resources.requests.storage", message="is required"))
    return out


def _secret_problems(obj: str, doc: Mapping[str, Any]) -> list[Problem]:
    out = []
    for key in ("data", "stringData"):
        values = doc.get(key)
        if values is None:
            continue
        if not isinstance(values, Mapping):
            out.append(Problem(obj=obj, path=key, message="must map key names to values"))
            continue
        for k, v in values.items():
            if not isinstance(v, str):
                out.append(Problem(obj=obj, path=f"{key}.{k}", message="must be a string"))
            elif key == "data":
                try:
                    base64.b64decode(v, validate=True)
                except (binascii.Error, ValueError):
                    out.append(Problem(obj=obj, path=f"{key}.{k}", message="is not base64"))
        if values:
            out.append(
                Problem(
                    obj=obj,
                    path=key,
                    message="secret values in a manifest file (anyone who reads the file or "
                    "its repository has them); create the Secret with kubectl instead",
                    error=False,
                )
            )
    return out


def _peer_ports_problems(obj: str, base: str, rules: object) -> list[Problem]:
    out = []
    for i, rule in enumerate(rules if isinstance(rules, list) else []):
        for j, port in enumerate(_m(rule).get("ports") or []):
            value = _m(port).get("port")
            if value is not None and not isinstance(value, str) and _bad_port(value):
                path = f"{base}[{i}].ports[{j}].port"
                out.append(Problem(obj=obj, path=path, message=f"{value!r} is not 1..65535"))
    return out


def _network_policy_problems(obj: str, doc: Mapping[str, Any]) -> list[Problem]:
    spec = doc.get("spec")
    if not isinstance(spec, Mapping):
        return [Problem(obj=obj, path="spec", message="is required")]
    out = []
    if not isinstance(spec.get("podSelector"), Mapping):
        out.append(
            Problem(obj=obj, path="spec.podSelector", message="is required ({} selects all)")
        )
    types = spec.get("policyTypes")
    for i, t in enumerate(types if isinstance(types, list) else []):
        if t not in _POLICY_TYPES:
            out.append(
                Problem(obj=obj, path=f"spec.policyTypes[{i}]", message=f"{t!r} not Ingress/Egress")
            )
    out += _peer_ports_problems(obj, "spec.ingress", spec.get("ingress"))
    out += _peer_ports_problems(obj, "spec.egress", spec.get("egress"))
    return out


STRUCTURAL: dict[str, Callable[[str, Mapping[str, Any]], list[Problem]]] = {
    "Deployment": _workload_problems,
    "StatefulSet": _workload_problems,
    "Service": _service_problems,
    "PersistentVolumeClaim": _pvc_problems,
    "Secret": _secret_problems,
    "NetworkPolicy": _network_policy_problems,
}


def kubernetes_validate() -> Any | None:
    """The ``kubernetes_validate`` module, or None when it is not installed."""
    try:
        import kubernetes_validate
        import kubernetes_validate.utils
    except ImportError:
        return None
    return kubernetes_validate


def core_schema_problems(
    kv: Any, obj: str, doc: Mapping[str, Any], version: str, path_prefix: Sequence[Any] = ()
) -> list[Problem]:
    """Kubernetes' own schema (strict: unknown fields too) for one core object."""
    try:
        kv.validate(dict(doc), version, strict=True)
    except kv.ValidationError as err:
        path = list(err.absolute_path)
        message = err.message
        if err.validator == "additionalProperties" and isinstance(err.instance, Mapping):
            allowed = err.schema.get("properties", {})
            extras = sorted(k for k in err.instance if k not in allowed)
            if extras:
                path, message = [*path, extras[0]], "unknown field"
        return [Problem(obj=obj, path=dotted([*path_prefix, *path]), message=message)]
    except kv.utils.SchemaNotFoundError as err:
        return [Problem(obj=obj, path="", message=err.message)]
    return []


def template_problems(
    kv: Any, obj: str, template: object, version: str, parent: Sequence[Any], *, kind: str
) -> list[Problem]:
    """An embedded template at ``parent + ["template"]`` in ``obj``, checked as the core
    object Kubernetes makes of it: a ``PodTemplateSpec`` (``kind="Pod"``) or a
    ``JobTemplateSpec`` (``kind="Job"``, its pod template included)."""
    if not isinstance(template, Mapping):
        return []
    if kind == "Pod":
        wrapper: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": "t"},
            "template": template,
        }
        return core_schema_problems(kv, obj, wrapper, version, list(parent))
    meta = dict(_m(template.get("metadata")))
    meta["name"] = "t"
    wrapper = {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta}
    if "spec" in template:
        wrapper["spec"] = template["spec"]
    return core_schema_problems(kv, obj, wrapper, version, [*parent, "template"])
