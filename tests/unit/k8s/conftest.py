"""Fixtures for the k8s tests: paths, the example spec, the shared Kubeflow CRD (optional)."""

from __future__ import annotations

from typing import Any

import pytest
from k8s_paths import CRD_FILE


@pytest.fixture(scope="session")
def crd_schema() -> dict[str, Any]:
    """The real PyTorchJob ``openAPIV3Schema`` (Kubeflow's file, never committed here)."""
    if not CRD_FILE.exists():
        pytest.skip(f"{CRD_FILE} absent: the shared Kubeflow CRD is only present in CI checkouts")
    import yaml

    crd = yaml.safe_load(CRD_FILE.read_text(encoding="utf-8"))
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return version["schema"]["openAPIV3Schema"]
