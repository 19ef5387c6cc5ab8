"""Paths shared by the k8s tests (a uniquely named module: every test dir has a conftest)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
GOLDEN = REPO / "tests" / "golden" / "k8s"
EXAMPLE = REPO / "examples" / "k8s" / "job.yaml"
SHARED_SCHEMAS = REPO.parent / "shared" / "schemas"
CRD_FILE = SHARED_SCHEMAS / "kubeflow.org_pytorchjobs.yaml"
TRAINJOB_EXAMPLE = REPO / "examples" / "k8s" / "trainjob.yaml"
TRAINER_CRDS = SHARED_SCHEMAS / "trainer-v2.3.0"
