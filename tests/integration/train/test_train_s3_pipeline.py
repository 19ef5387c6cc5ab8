"""A pipeline train stage whose ``train.checkpointUrl`` is a bucket on the test S3 server:
the stage's script gets the URL and the storage options from the runner's environment
only (``Checkpointer(os.environ["FLEXRUN_CHECKPOINT_DIR"], storage_options="env")``),
saves, and a rerun after its input changed loads that checkpoint (nothing under a URL is
ever removed). Credentials are the server's dummies in the environment, never in the
spec."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from s3_support import S3

pytestmark = pytest.mark.timeout(300)

_SCRIPT = """
import os, sys
import torch
import flexrun.train as ft

ft.init()
model = torch.nn.Linear(2, 2)
ckpt = ft.Checkpointer(os.environ["FLEXRUN_CHECKPOINT_DIR"], storage_options="env")
ckpt.register("model", model)
loaded = ckpt.load()
step = 0 if loaded is None else loaded.step
ckpt.save(step + 1, blocking=True)
ckpt.close()
with open(sys.argv[1], "w") as f:
    f.write(f"{step}->{step + 1}")
ft.shutdown()
"""


def _run(spec: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
    env.pop("FLEXRUN_CHECKPOINT_STORAGE_OPTIONS", None)
    env.pop("FLEXRUN_CHECKPOINT_DIR", None)
    return subprocess.run(
        [sys.executable, "-m", "flexrun", "pipeline", "run", str(spec), "--run-dir", "run"],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=cwd,
    )


def test_a_train_stage_checkpoints_to_its_checkpoint_url(tmp_path: Path, s3: S3) -> None:
    (tmp_path / "fit.py").write_text(_SCRIPT)
    (tmp_path / "seed.txt").write_text("one")
    options = {"endpoint_url": s3.endpoint, "client_kwargs": {"region_name": "us-east-1"}}
    spec = tmp_path / "pipeline.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "name": "s3ckpt",
                "stages": [
                    {
                        "name": "fit",
                        "inputs": ["{pipeline_dir}/seed.txt"],
                        "outputs": ["out.txt"],
                        "train": {
                            "script": "{pipeline_dir}/fit.py",
                            "args": ["out.txt"],
                            "maxRestarts": 0,
                            "checkpointUrl": s3.url("fit"),
                            "storageOptions": options,
                        },
                    }
                ],
            }
        )
    )
    first = _run(spec, tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    assert (tmp_path / "run" / "out.txt").read_text() == "0->1"
    keys = s3.keys("fit/")
    assert keys, "nothing was written under the checkpoint URL"
    assert not (tmp_path / "run" / "fit").exists()

    (tmp_path / "seed.txt").write_text("two")  # the stage's key changes: it reruns ...
    second = _run(spec, tmp_path)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "removing stale checkpoints" not in second.stdout
    # ... and resumes from the object store, which the runner left alone.
    assert (tmp_path / "run" / "out.txt").read_text() == "1->2"
