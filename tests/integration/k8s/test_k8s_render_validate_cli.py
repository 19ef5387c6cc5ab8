"""Issue 18's acceptance through the real CLI: ``python -m flexrun k8s render`` of every
golden job spec (tcp and etcd stores, PyTorchJob and TrainJob), with secrets planted in
the renderer's environment, writes manifests that hold no secret value, include the
NetworkPolicy and the (empty) Secrets (or reference the spec's existing ones), and pass ``python -m flexrun k8s validate``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.timeout(180)

REPO = Path(__file__).resolve().parents[3]
GOLDEN = REPO / "tests" / "golden" / "k8s"
SENTINEL = "s3cr3t-SENTINEL-v4lue"


def _flexrun(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PET_")}
    env["PYTHONPATH"] = str(REPO / "src")
    for name in ("FLEXRUN_JOB_SECRET", "FLEXRUN_ETCD_PASSWORD"):
        env[name] = SENTINEL
    env["PET_RDZV_CONF"] = f"password={SENTINEL}"
    return subprocess.run(
        [sys.executable, "-m", "flexrun", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


@pytest.mark.parametrize("spec", ["tcp", "etcd", "trainjob", "trainjob-etcd"])
def test_rendered_manifests_hold_no_secret_and_validate_with_policy_and_secrets(
    tmp_path: Path, spec: str
) -> None:
    out = tmp_path / f"{spec}.yaml"
    res = _flexrun("k8s", "render", str(GOLDEN / f"{spec}.job.yaml"), "-o", str(out))
    assert res.returncode == 0, res.stderr
    text = out.read_text()
    assert SENTINEL not in text and SENTINEL not in res.stdout + res.stderr
    docs = [d for d in yaml.safe_load_all(text) if d]
    kinds = [d["kind"] for d in docs]
    assert "NetworkPolicy" in kinds, kinds
    if spec == "trainjob-etcd":  # its spec names existing Secrets: referenced, not rendered
        assert "Secret" not in kinds and "llm-job-secret" in text and "llm-etcd-certs" in text
    else:
        assert "Secret" in kinds, kinds
    for secret in (d for d in docs if d["kind"] == "Secret"):
        assert "data" not in secret and "stringData" not in secret, secret["metadata"]["name"]
    res = _flexrun("k8s", "validate", str(out))
    assert res.returncode == 0, res.stdout + res.stderr
