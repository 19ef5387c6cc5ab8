"""Manifest checks, offline: Kubeflow v1 and Trainer v2 objects, core objects, across them.

Owns ``flexrun k8s validate``'s verdict on a list of manifests (generated or hand-written),
by dispatching each object to its checker and collecting every :class:`Problem`:

- ``PyTorchJob`` (``kubeflow.org/v1``): flexrun's derived schema plus the Kubeflow
  admission-webhook rules (``_pytorchjob_rules``);
- ``TrainJob``, ``TrainingRuntime``, ``ClusterTrainingRuntime``
  (``trainer.kubeflow.org/v1alpha1``): the v2.3.0 CRD schemas shipped in the package,
  then the controller-only rules, including across objects (the runtime a TrainJob
  references must be in the set; ``numNodes`` within the runtime's node range)
  (``validate_trainer``);
- core objects (Deployment, StatefulSet, Service, PVC, Secret, NetworkPolicy, ...) and the
  pod and job templates embedded in the Kubeflow objects: Kubernetes' own schemas through
  ``kubernetes-validate`` when installed, flexrun's structural checks always
  (``core_checks``);
- the worker pods of both, against the object around them: the launcher's ``--nnodes``
  against the pods, unexpanded ``$VAR``, spot grace, ``/dev/shm``, GPUs per process
  (``launch_checks``).

It never needs the network: the Trainer schemas are package data (their source and
version are in ``schemas/README.md``), the PyTorchJob rules are code, Kubernetes' schemas
ship with ``kubernetes-validate``. It does not render anything.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from flexrun._spec import load_yaml_documents, parse_yaml_documents
from flexrun.errors import SpecError
from flexrun.k8s import core_checks, launch_checks, validate_trainer
from flexrun.k8s._pytorchjob_rules import check_pytorchjob
from flexrun.k8s.core_checks import KUBERNETES_VALIDATE_REQUIREMENT
from flexrun.k8s.problems import Problem, Report, dedupe, name_of


def _m(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _pytorchjob_templates(kv: Any, obj: str, doc: Mapping[str, Any], version: str) -> list[Problem]:
    out = []
    for rtype, rspec in _m(_m(doc.get("spec")).get("pytorchReplicaSpecs")).items():
        template = _m(rspec).get("template")
        parent = ["spec", "pytorchReplicaSpecs", rtype]
        out += core_checks.template_problems(kv, obj, template, version, parent, kind="Pod")
    return out


def _runtime_templates(kv: Any, obj: str, doc: Mapping[str, Any], version: str) -> list[Problem]:
    out = []
    jobs = _m(_m(_m(doc.get("spec")).get("template")).get("spec")).get("replicatedJobs")
    for i, job in enumerate(jobs if isinstance(jobs, list) else []):
        parent = ["spec", "template", "spec", "replicatedJobs", i]
        template = _m(job).get("template")
        out += core_checks.template_problems(kv, obj, template, version, parent, kind="Job")
    return out


class _TrainerSet:
    """The Trainer objects of one set: checked alone as they come, across at the end."""

    def __init__(self) -> None:
        self.runtimes: dict[tuple[str, str, str | None], validate_trainer.Runtime] = {}
        self.jobs: list[tuple[str, Mapping[str, Any]]] = []

    def add(self, obj: str, doc: Mapping[str, Any]) -> list[Problem]:
        problems = validate_trainer.schema_check(obj, doc)
        if doc.get("kind") == "TrainJob":
            self.jobs.append((obj, doc))
        elif doc.get("kind") in validate_trainer.RUNTIME_KINDS:
            found, runtime = validate_trainer.runtime_problems(obj, doc)
            problems += found
            if runtime is not None:
                self.runtimes[(runtime.kind, runtime.name, runtime.namespace)] = runtime
        return problems

    def across(self, installed: Iterable[str]) -> list[Problem]:
        out = []
        for obj, doc in self.jobs:
            out += validate_trainer.trainjob_problems(obj, doc, self.runtimes, installed)
        return out


def _check_version(version: str, bundled: list[str]) -> None:
    """``--kubernetes-version`` names schemas that are bundled (X.Y or X.Y.Z).

    Raises:
        SpecError: it does not.
    """
    minors = sorted(
        {".".join(v.split(".")[:2]) for v in bundled}, key=lambda v: tuple(map(int, v.split(".")))
    )
    if (
        not re.fullmatch(r"\d{1,3}\.\d{1,3}(\.\d{1,3})?", version)
        or ".".join(version.split(".")[:2]) not in minors
    ):
        raise SpecError(
            f"--kubernetes-version {version!r}: expected X.Y of a bundled schema "
            f"({minors[0]} to {minors[-1]})"
        )


def validate_documents(
    docs: Sequence[object],
    *,
    kubernetes_version: str | None = None,
    use_core_schemas: bool = True,
    installed_runtimes: Iterable[str] = (),
) -> Report:
    """Check every manifest; never raises for a bad manifest (that is a :class:`Problem`).

    ``kubernetes_version`` picks the Kubernetes schemas (default: the newest bundled with
    kubernetes-validate). ``use_core_schemas=False`` forces the structural-only mode.
    ``installed_runtimes``: ``Kind/name`` of Trainer runtimes the cluster already has, so
    a TrainJob may reference them without them being in ``docs``.
    """
    kv = core_checks.kubernetes_validate() if use_core_schemas else None
    notes = []
    if kv is None:
        notes.append(
            "core objects and pod templates: structural checks only; for Kubernetes' own "
            f"schemas install {KUBERNETES_VALIDATE_REQUIREMENT!r} (works offline)"
        )
        version = ""
    else:
        version = kubernetes_version or kv.utils.latest_version()
        _check_version(version, kv.utils.all_versions())
        notes.append(
            f"core objects checked against Kubernetes {version} schemas (kubernetes-validate)"
        )
    problems: list[Problem] = []
    checked = []
    trainer = _TrainerSet()
    for i, doc in enumerate(docs):
        if doc is None:
            continue
        obj = name_of(doc, i)
        checked.append(obj)
        if not isinstance(doc, Mapping) or not isinstance(doc.get("kind"), str):
            problems.append(
                Problem(obj=obj, path="kind", message="not a Kubernetes object (no kind)")
            )
            continue
        kind, api = doc["kind"], doc.get("apiVersion")
        if kind == "PyTorchJob" or (isinstance(api, str) and api.startswith("kubeflow.org/")):
            problems += check_pytorchjob(obj, doc)
            problems += launch_checks.pytorchjob_pod_problems(obj, doc)
            if kv is not None:
                problems += _pytorchjob_templates(kv, obj, doc, version)
            continue
        if validate_trainer.is_trainer_kind(doc):
            problems += trainer.add(obj, doc)
            if kind in validate_trainer.RUNTIME_KINDS:
                problems += launch_checks.runtime_pod_problems(obj, doc)
            if kv is not None and kind in validate_trainer.RUNTIME_KINDS:
                problems += _runtime_templates(kv, obj, doc, version)
            continue
        structural = core_checks.STRUCTURAL.get(kind)
        if structural is not None:
            problems += structural(obj, doc)
        if kv is not None:
            problems += core_checks.core_schema_problems(kv, obj, doc, version)
        elif structural is None:
            problems.append(
                Problem(
                    obj=obj,
                    path="kind",
                    message=f"{kind} not checked: needs {KUBERNETES_VALIDATE_REQUIREMENT!r}",
                    error=False,
                )
            )
    problems += trainer.across(installed_runtimes)
    return Report(problems=tuple(dedupe(problems)), notes=tuple(notes), checked=tuple(checked))


def _flatten(docs: list[Any]) -> list[object]:
    flat: list[object] = []
    for d in docs:
        if isinstance(d, Mapping) and d.get("kind") == "List" and isinstance(d.get("items"), list):
            flat.extend(d["items"])
        else:
            flat.append(d)
    return flat


def load_documents(path: str | Path) -> list[object]:
    """Every YAML document of a manifest file (``-`` is not special here).

    Raises:
        SpecError: the file cannot be read, is binary or not UTF-8, or is not YAML.
    """
    return _flatten(load_yaml_documents(path, "manifest file"))


def parse_documents(text: str, source: str = "<manifests>") -> list[object]:
    """Every YAML document of a manifest stream; a ``kind: List`` is flattened."""
    return _flatten(parse_yaml_documents(text, source))


def validate_file(path: str | Path, **kwargs: Any) -> Report:
    """:func:`validate_documents` over a file's documents.

    Raises:
        SpecError: the file cannot be read, is not YAML, or holds no object.
    """
    docs = load_documents(path)
    if not docs:
        raise SpecError(f"{path}: no Kubernetes objects found")
    return validate_documents(docs, **kwargs)


__all__ = [
    "KUBERNETES_VALIDATE_REQUIREMENT",
    "Problem",
    "Report",
    "check_pytorchjob",
    "load_documents",
    "parse_documents",
    "validate_documents",
    "validate_file",
]
