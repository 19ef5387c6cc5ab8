"""torchdata ``StatefulDataLoader`` over an HF map-style ``datasets.Dataset`` with
``ElasticSampler`` as its ``batch_sampler``, under ``flexrun run`` (real processes, gloo, a
DDP model, a loader worker process): restarted at 2 -> 1 -> 2 workers inside an epoch and
across the epoch boundary, every sample of every epoch is trained once. (The same positions
without processes, with and without loader workers: tests/unit/train/test_sampler_libraries.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from libs_support import assert_each_once, needs, run, trained

pytestmark = [pytest.mark.timeout(480), needs("torchdata", "datasets")]

N, EPOCHS, PER_EPOCH = 60, 2, 8  # global batch 8: 7 steps of 8 samples and one of 4


def test_stateful_dataloader_over_hf_dataset_every_sample_once_across_2_1_2(
    tmp_path: Path,
) -> None:
    log = tmp_path / "samples"
    common = ["--ckpt", str(tmp_path / "ckpt"), "--sample-log", str(log), "--samples", str(N)]
    run(tmp_path, 2, "loader_worker.py", *common, "--stop-at", "3")
    run(tmp_path, 1, "loader_worker.py", *common, "--stop-at", "10")  # across epoch 0 -> 1
    out = run(tmp_path, 2, "loader_worker.py", *common)
    assert f"done at step {EPOCHS * PER_EPOCH} of {EPOCHS * PER_EPOCH}" in out, out[-3000:]
    assert_each_once(trained(log, PER_EPOCH), EPOCHS, N)
