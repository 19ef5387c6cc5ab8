"""Manifest checks: PyTorchJob schema + operator webhook rules, core objects, offline.

Owns ``flexrun k8s validate``'s verdict on a list of manifests (generated or hand-written):

- ``PyTorchJob``: flexrun's derived schema (``_pytorchjob_rules``: the CRD's fields and
  types, closed against unknown fields, with enums), then the Kubeflow admission-webhook
  rules no schema expresses (replica types, one Master, a ``pytorch`` container with an
  image in every replica, ``elasticPolicy`` needs Workers, no deprecated ``nProcPerNode``
  next to ``spec.nprocPerNode``), then consistency (min <= max).
- Core objects (Deployment, StatefulSet, Service, PVC, ...) and the PyTorchJob's pod
  template: Kubernetes' own schemas through ``kubernetes-validate`` (it ships them, so it
  works offline) when installed; structural checks of flexrun's own always (selectors that
  match their pods, containers with images, ports, storage requests).

It never needs the network or the CRD file: that file belongs to Kubeflow and is used only
by the tests, to check these rules against it. It does not render anything.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flexrun.errors import SpecError
from flexrun.k8s import _pytorchjob_rules as rules

KUBERNETES_VALIDATE_REQUIREMENT = "kubernetes-validate>=1.28"
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_OPERATOR_ENV = re.compile(r"^(PET_[A-Z_]+|MASTER_ADDR|MASTER_PORT|WORLD_SIZE|RANK)$")
_ACCESS_MODES = ("ReadWriteOnce", "ReadWriteMany", "ReadWriteOncePod", "ReadOnlyMany")


@dataclass(frozen=True, kw_only=True, slots=True)
class Problem:
    """One finding about one object."""

    obj: str
    """``Kind/name`` of the object (``doc N`` when it has neither)."""
    path: str
    """Dotted path of the offending field inside the object (``""`` for the whole object)."""
    message: str
    error: bool = True
    """False for a warning: legal, but probably not what was meant."""

    def __str__(self) -> str:
        where = f"{self.obj}: {self.path}" if self.path else self.obj
        return f"{where}: {'' if self.error else 'warning: '}{self.message}"


@dataclass(frozen=True, kw_only=True, slots=True)
class Report:
    """The verdict on a set of manifests."""

    problems: tuple[Problem, ...] = ()
    notes: tuple[str, ...] = ()
    """What was and was not checked (e.g. the core schemas were unavailable)."""
    checked: tuple[str, ...] = field(default_factory=tuple)
    """``Kind/name`` of every object looked at."""

    @property
    def errors(self) -> tuple[Problem, ...]:
        return tuple(p for p in self.problems if p.error)

    @property
    def ok(self) -> bool:
        return not self.errors


def _dotted(parts: Iterable[Any]) -> str:
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _schema_problems(obj_name: str, schema: Mapping[str, Any], doc: object) -> list[Problem]:
    import jsonschema

    validator = jsonschema.Draft7Validator(schema)
    found = []
    for err in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path))):
        path = list(err.absolute_path)
        if err.validator == "additionalProperties" and isinstance(err.instance, Mapping):
            allowed = err.schema.get("properties", {})
            for extra in sorted(k for k in err.instance if k not in allowed):
                found.append(
                    Problem(obj=obj_name, path=_dotted([*path, extra]), message="unknown field")
                )
            continue
        message = err.message
        if err.validator == "enum":
            message = f"{err.instance!r} not one of {', '.join(map(str, err.validator_value))}"
        found.append(Problem(obj=obj_name, path=_dotted(path), message=message))
    return found


def _name_of(doc: object, index: int) -> str:
    if isinstance(doc, Mapping):
        meta = doc.get("metadata")
        name = meta.get("name") if isinstance(meta, Mapping) else None
        kind = doc.get("kind")
        if isinstance(kind, str) and isinstance(name, str):
            return f"{kind}/{name}"
        if isinstance(kind, str):
            return f"{kind} (doc {index + 1})"
    return f"doc {index + 1}"


# --- PyTorchJob --------------------------------------------------------------------------


def _webhook_problems(obj: str, job: Mapping[str, Any]) -> list[Problem]:
    """The Kubeflow v1 admission webhook's rules, which the CRD schema cannot express."""
    out: list[Problem] = []

    def bad(path: str, message: str, error: bool = True) -> None:
        out.append(Problem(obj=obj, path=path, message=message, error=error))

    name = job.get("metadata", {}).get("name")
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
        if rtype not in rules.REPLICA_TYPES:
            bad(base, f"replica type {rtype!r} not one of {', '.join(rules.REPLICA_TYPES)}")
            continue
        if not isinstance(rspec, Mapping):
            bad(base, "must be a replica spec")
            continue
        count = rspec.get("replicas")
        if rtype == "Master" and count is not None and count != 1:
            bad(f"{base}.replicas", f"there must be exactly 1 Master replica (got {count})")
        if rtype == "Worker" and isinstance(count, int) and count < 1:
            bad(f"{base}.replicas", f"Worker needs at least 1 replica (got {count})")
        pod = (rspec.get("template") or {}).get("spec") or {}
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
    return _schema_problems(obj, rules.PYTORCHJOB, job) + _webhook_problems(obj, job)


# --- core objects ----------------------------------------------------------------------


def _containers_problems(obj: str, base: str, pod: object) -> list[Problem]:
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
    labels = (template.get("metadata") or {}).get("labels") or {}
    selector = (spec.get("selector") or {}).get("matchLabels")
    if not isinstance(selector, Mapping) or not selector:
        out.append(Problem(obj=obj, path="spec.selector.matchLabels", message="is required"))
    else:
        for k, v in selector.items():
            if labels.get(k) != v:
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
    out += _containers_problems(obj, "spec.template.spec", template.get("spec"))
    return out


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
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
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
    storage = ((spec.get("resources") or {}).get("requests") or {}).get("storage")
    if storage is None and not spec.get("volumeName"):
        out.append(Problem(obj=obj, path="spec.resources.requests.storage", message="is required"))
    return out


_STRUCTURAL = {
    "Deployment": _workload_problems,
    "StatefulSet": _workload_problems,
    "Service": _service_problems,
    "PersistentVolumeClaim": _pvc_problems,
}


def _kubernetes_validate() -> Any | None:
    try:
        import kubernetes_validate
        import kubernetes_validate.utils
    except ImportError:
        return None
    return kubernetes_validate


def _core_schema_problems(
    kv: Any, obj: str, doc: Mapping[str, Any], version: str, path_prefix: Sequence[Any] = ()
) -> list[Problem]:
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
        return [Problem(obj=obj, path=_dotted([*path_prefix, *path]), message=message)]
    except kv.utils.SchemaNotFoundError as err:
        return [Problem(obj=obj, path="", message=err.message)]
    return []


def validate_documents(
    docs: Sequence[object], *, kubernetes_version: str | None = None, use_core_schemas: bool = True
) -> Report:
    """Check every manifest; never raises for a bad manifest (that is a :class:`Problem`).

    ``kubernetes_version`` picks the Kubernetes schemas (default: the newest bundled with
    kubernetes-validate). ``use_core_schemas=False`` forces the structural-only mode.
    """
    kv = _kubernetes_validate() if use_core_schemas else None
    notes = []
    if kv is None:
        notes.append(
            "core objects and pod templates: structural checks only; for Kubernetes' own "
            f"schemas install {KUBERNETES_VALIDATE_REQUIREMENT!r} (works offline)"
        )
        version = ""
    else:
        version = kubernetes_version or kv.utils.latest_version()
        notes.append(
            f"core objects checked against Kubernetes {version} schemas (kubernetes-validate)"
        )
    problems: list[Problem] = []
    checked = []
    for i, doc in enumerate(docs):
        if doc is None:
            continue
        obj = _name_of(doc, i)
        checked.append(obj)
        if not isinstance(doc, Mapping) or not isinstance(doc.get("kind"), str):
            problems.append(
                Problem(obj=obj, path="kind", message="not a Kubernetes object (no kind)")
            )
            continue
        kind, api = doc["kind"], doc.get("apiVersion")
        if kind == "PyTorchJob" or (isinstance(api, str) and api.startswith("kubeflow.org/")):
            problems += check_pytorchjob(obj, doc)
            if kv is not None:
                for rtype, rspec in (doc.get("spec", {}).get("pytorchReplicaSpecs") or {}).items():
                    template = rspec.get("template") if isinstance(rspec, Mapping) else None
                    if isinstance(template, Mapping):
                        # The template is a core PodTemplateSpec; check it as one.
                        wrapper = {
                            "apiVersion": "v1",
                            "kind": "PodTemplate",
                            "metadata": {"name": "t"},
                            "template": template,
                        }
                        prefix = ["spec", "pytorchReplicaSpecs", rtype]
                        problems += _core_schema_problems(kv, obj, wrapper, version, prefix)
            continue
        structural = _STRUCTURAL.get(kind)
        if structural is not None:
            problems += structural(obj, doc)
        if kv is not None:
            problems += _core_schema_problems(kv, obj, doc, version)
        elif structural is None:
            problems.append(
                Problem(
                    obj=obj,
                    path="kind",
                    message=f"{kind} not checked: needs {KUBERNETES_VALIDATE_REQUIREMENT!r}",
                    error=False,
                )
            )
    return Report(problems=tuple(_dedupe(problems)), notes=tuple(notes), checked=tuple(checked))


def _dedupe(problems: Iterable[Problem]) -> list[Problem]:
    seen: set[tuple[str, str, str]] = set()
    out = []
    for p in problems:
        key = (p.obj, p.path, p.message)
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


def load_documents(path: str | Path) -> list[object]:
    """Every YAML document of a manifest file (``-`` is not special here).

    Raises:
        SpecError: the file cannot be read or is not YAML.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecError(f"{path}: cannot read manifests ({exc.strerror})") from exc
    return parse_documents(text, str(path))


def parse_documents(text: str, source: str = "<manifests>") -> list[object]:
    """Every YAML document of a manifest stream; a ``kind: List`` is flattened."""
    import yaml

    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise SpecError(f"{source}: not valid YAML ({exc})".replace("\n", " ")) from exc
    flat: list[object] = []
    for d in docs:
        if isinstance(d, Mapping) and d.get("kind") == "List" and isinstance(d.get("items"), list):
            flat.extend(d["items"])
        else:
            flat.append(d)
    return flat


def validate_file(path: str | Path, **kwargs: Any) -> Report:
    """:func:`validate_documents` over a file's documents.

    Raises:
        SpecError: the file cannot be read, is not YAML, or holds no object.
    """
    docs = load_documents(path)
    if not docs:
        raise SpecError(f"{path}: no Kubernetes objects found")
    return validate_documents(docs, **kwargs)
