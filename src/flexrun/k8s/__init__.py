"""Kubernetes support: flexrun's job spec -> Kubeflow PyTorchJob + store manifests; checks.

Owns nothing itself; it re-exports the public names of ``spec`` (the job spec),
``render`` (spec -> plain dicts -> YAML) and ``validate`` (manifests -> problems).
``commands`` wires them to ``flexrun k8s render|validate``. PyYAML (the ``k8s`` extra)
is imported only when a file is read or written.
"""

from __future__ import annotations

from flexrun.k8s.render import render, to_yaml
from flexrun.k8s.spec import JobSpec, load_job_spec, parse_job_spec

__all__ = ["JobSpec", "load_job_spec", "parse_job_spec", "render", "to_yaml"]
