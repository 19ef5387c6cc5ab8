"""Lightning under ``flexrun run`` with :mod:`flexrun.integrations.lightning` (the real
lightning, a tiny module, gloo): restarted at 2 -> 1 -> 2 workers every sample of every epoch
is trained once; a SIGTERM to the agent saves ``last.ckpt`` before exit 143 and the job
resumes from it with no step lost."""

from __future__ import annotations

from pathlib import Path

import pytest
from libs_support import (
    assert_each_once,
    last_step,
    needs,
    run,
    sigterm_after,
    trained,
    worker_preempted,
)

pytestmark = [pytest.mark.timeout(480), needs("lightning")]

N, EPOCHS, PER_EPOCH = 60, 2, 8  # global batch 8: 7 steps of 8 samples and one of 4


def test_lightning_every_sample_once_across_2_1_2(tmp_path: Path) -> None:
    out, log = tmp_path / "out", tmp_path / "samples"
    common = ["--out", str(out), "--sample-log", str(log), "--samples", str(N)]
    assert "done at step 5" in run(tmp_path, 2, "lightning_worker.py", *common, "--stop-at", "5")
    second = run(tmp_path, 1, "lightning_worker.py", *common, "--stop-at", "11")
    assert "done at step 11" in second, second[-3000:]
    third = run(tmp_path, 2, "lightning_worker.py", *common)
    assert f"done at step {EPOCHS * PER_EPOCH}" in third, third[-3000:]
    assert_each_once(trained(log, PER_EPOCH), EPOCHS, N)


def test_sigterm_to_the_agent_saves_last_ckpt_then_143_and_resumes_with_no_step_lost(
    tmp_path: Path,
) -> None:
    import torch

    out, log = tmp_path / "out", tmp_path / "samples"
    common = ["--out", str(out), "--sample-log", str(log), "--samples", str(N)]
    no_periodic = ["--save-every", "1000", "--step-sleep", "0.3"]
    code, output = sigterm_after(tmp_path, "lightning_worker.py", log, *common, *no_periodic)
    assert code == 143, output[-4000:]
    pre = worker_preempted(tmp_path / "run0")
    assert pre["exit_code"] == 143, pre
    ckpt = torch.load(out / "last.ckpt", map_location="cpu", weights_only=False)
    step = ckpt["global_step"]
    # Every step that was trained (logged with the global step before it) is in the checkpoint.
    assert last_step(log) == step - 1, (last_step(log), step)

    again = run(tmp_path, 2, "lightning_worker.py", *common)
    assert f"done at step {EPOCHS * PER_EPOCH}" in again, again[-3000:]
    assert_each_once(trained(log, PER_EPOCH), EPOCHS, N)
