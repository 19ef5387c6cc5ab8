"""Lightning under ``flexrun run`` with :mod:`flexrun.integrations.lightning` (the real
lightning, a tiny module, gloo): restarted at 2 -> 1 -> 2 workers every sample of every epoch
is trained once; a SIGTERM to the agent saves ``last.ckpt`` before exit 143 and the job
resumes from it with no step lost."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
from libs_support import assert_each_once, env, flexrun_cmd, needs, reap, run, trained

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


def _last_step(log: Path) -> int:
    steps = [int(line.split()[0]) for p in log.parent.glob(f"{log.name}.*")
             for line in p.read_text().splitlines()]  # fmt: skip
    return max(steps, default=-1)


def test_sigterm_to_the_agent_saves_last_ckpt_then_143_and_resumes_with_no_step_lost(
    tmp_path: Path,
) -> None:
    import torch

    out, log = tmp_path / "out", tmp_path / "samples"
    common = ["--out", str(out), "--sample-log", str(log), "--samples", str(N)]
    no_periodic = ["--save-every", "1000", "--step-sleep", "0.3"]
    agent = subprocess.Popen(
        flexrun_cmd(tmp_path, 2, "lightning_worker.py", *common, *no_periodic),
        cwd=tmp_path, env=env(), text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 150
        while _last_step(log) < 3 and agent.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert agent.poll() is None, agent.communicate()[0][-4000:]
        assert _last_step(log) >= 3, "no step 3 within 150 s"
        agent.send_signal(signal.SIGTERM)
        output, _ = agent.communicate(timeout=60)
    finally:
        reap(agent)
    assert agent.returncode == 143, output[-4000:]
    events = [
        json.loads(line) for line in (tmp_path / "run0" / "events.jsonl").read_text().splitlines()
    ]
    (pre,) = [e for e in events if e["event"] == "preempted" and "rank" in e]  # (a worker)
    assert pre["exit_code"] == 143, pre
    ckpt = torch.load(out / "last.ckpt", map_location="cpu", weights_only=False)
    step = ckpt["global_step"]
    # Every step that was trained (logged with the global step before it) is in the checkpoint.
    assert _last_step(log) == step - 1, (_last_step(log), step)

    again = run(tmp_path, 2, "lightning_worker.py", *common)
    assert f"done at step {EPOCHS * PER_EPOCH}" in again, again[-3000:]
    assert_each_once(trained(log, PER_EPOCH), EPOCHS, N)
