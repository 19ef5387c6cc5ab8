"""Kubernetes support: flexrun's job spec -> manifests (PyTorchJob or TrainJob); checks.

Owns nothing itself; it re-exports the public names of ``spec`` (the job spec, its parts in
``spec_types``), ``render`` (spec -> plain dicts -> YAML; the workers of each target in
``render``/``trainjob``, their pods in ``pods``, the store, Secrets, NetworkPolicies and
PVC in ``objects``) and ``validate`` (manifests -> problems: ``_pytorchjob_rules``,
``validate_trainer`` with the shipped Trainer v2.3.0 schemas of ``_trainer_schema``,
``core_checks``). ``commands`` wires them to ``flexrun k8s render|validate``. PyYAML and
jsonschema (the ``k8s`` extra) are imported only when a file is read or a manifest checked.
"""

from __future__ import annotations

from flexrun.k8s.render import render, to_yaml
from flexrun.k8s.spec import JobSpec, load_job_spec, parse_job_spec

__all__ = ["JobSpec", "load_job_spec", "parse_job_spec", "render", "to_yaml"]
