"""HF ``Trainer`` under ``flexrun run`` with :mod:`flexrun.integrations.hf` (the real
transformers, a tiny model, gloo): restarted at 2 -> 1 -> 2 workers every sample of every
epoch is trained once; a SIGTERM to the agent saves a checkpoint before exit 143 and the job
resumes from it with no step lost."""

from __future__ import annotations

import json
import re
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

pytestmark = [pytest.mark.timeout(480), needs("transformers", "datasets", "accelerate")]

N, GLOBAL_BATCH, EPOCHS = 60, 8, 2
PER_EPOCH = 8  # 7 steps of 8 samples and one of 4


def test_hf_trainer_every_sample_once_across_2_1_2(tmp_path: Path) -> None:
    out, log = tmp_path / "out", tmp_path / "samples"
    common = ["--out", str(out), "--sample-log", str(log), "--samples", str(N)]
    first = run(tmp_path, 2, "hf_worker.py", *common, "--stop-at", "5")
    assert "resume_from=None" in first and "done at step 5" in first
    second = run(tmp_path, 1, "hf_worker.py", *common, "--stop-at", "11")  # across epoch 0->1
    assert "resume_from=" + str(out / "checkpoint-5") in second, second[-3000:]
    third = run(tmp_path, 2, "hf_worker.py", *common)
    assert "resume_from=" + str(out / "checkpoint-11") in third, third[-3000:]
    assert f"done at step {EPOCHS * PER_EPOCH}" in third
    assert_each_once(trained(log, PER_EPOCH), EPOCHS, N)
    marker = json.loads((out / "checkpoint-11" / "flexrun.json").read_text())
    assert marker["world_size"] == 1 and marker["sampler"]["epoch"] == 1
    assert marker["sampler"]["consumed"] == 3 * GLOBAL_BATCH


def test_sigterm_to_the_agent_saves_then_143_and_resumes_with_no_step_lost(
    tmp_path: Path,
) -> None:
    out, log = tmp_path / "out", tmp_path / "samples"
    common = ["--out", str(out), "--sample-log", str(log), "--samples", str(N)]
    code, output = sigterm_after(tmp_path, "hf_worker.py", log, *common, "--step-sleep", "0.3")
    assert code == 143, output[-4000:]
    saved = sorted(int(m) for m in re.findall(r"checkpoint-(\d+)", " ".join(
        str(p) for p in out.glob("checkpoint-*/flexrun.json"))))  # fmt: skip
    assert len(saved) == 1, (saved, output[-3000:])
    step = saved[0]
    marker = json.loads((out / f"checkpoint-{step}" / "flexrun.json").read_text())
    assert marker["preempted"] is True
    pre = worker_preempted(tmp_path / "run0")
    assert pre["step"] == step and pre["exit_code"] == 143, pre
    # Every step that was trained (logged at its start as global_step before it) is in the
    # checkpoint: the last one logged is the checkpoint's last step.
    assert last_step(log) == step - 1, (last_step(log), step)

    again = run(tmp_path, 2, "hf_worker.py", *common)
    assert "resume_from=" + str(out / f"checkpoint-{step}") in again, again[-3000:]
    assert f"done at step {EPOCHS * PER_EPOCH}" in again
    assert_each_once(trained(log, PER_EPOCH), EPOCHS, N)
