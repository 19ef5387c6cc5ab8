"""Crash consistency and full disk, with real processes and a real (tmpfs) filesystem."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from flexrun.errors import CheckpointError
from flexrun.train import Checkpointer
from flexrun.train.commit import COMMIT_STAGES
from flexrun.train.context import single_process_context

DRIVER = Path(__file__).resolve().parent / "crash_driver.py"


def _drive(*args: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, str(DRIVER), *args], capture_output=True, text=True, timeout=100, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(120)
def test_kill_9_between_every_commit_step_leaves_old_or_new_complete_checkpoint(
    tmp_path: Path,
) -> None:
    report = _drive("stages", str(tmp_path))
    seen = {r["stage"]: r for r in report["results"]}
    assert list(seen) == list(COMMIT_STAGES)
    for stage, r in seen.items():
        assert r["signal"] == 9, r  # really killed at that point
        assert r["skipped"] == [], r  # nothing torn is ever visible
        expected = 2 if COMMIT_STAGES.index(stage) >= COMMIT_STAGES.index("renamed") else 1
        assert r["step"] == expected, r


@pytest.mark.timeout(120)
def test_kill_9_at_random_instants_during_saves_never_tears_a_checkpoint(tmp_path: Path) -> None:
    seed = random.randrange(1 << 30)
    report = _drive("random", str(tmp_path), "8", str(seed))
    steps = [r["step"] for r in report["results"]]
    assert all(r["skipped"] == [] for r in report["results"]), (seed, report)
    # The first launch may be killed before its first save commits; every later one finds one.
    assert all(s is not None for s in steps[1:]), (seed, report)
    assert steps[1:] == sorted(steps[1:]), (seed, report)  # resumed writers always go forward
    assert any(r["mid_save"] for r in report["results"]), report  # kills did land mid-save


class _Growing:
    def __init__(self, n: int) -> None:
        self.t = torch.ones(n)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"t": self.t}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.t = state["t"]


@pytest.fixture
def small_tmpfs(tmp_path: Path):
    mnt = tmp_path / f"tmpfs-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if r.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs here ({r.stderr.strip()}); injected ENOSPC is covered in unit tests"
        )
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.timeout(60)
def test_full_disk_keeps_previous_checkpoint_and_reports_the_error(small_tmpfs: Path) -> None:
    state = _Growing(100_000)  # 400 kB fits in 2 MB
    # max_failed_saves=1: the first failed save raises (by default training would go on
    # for two more; test_train_checkpoint_storage_failures.py covers that).
    c = Checkpointer(
        str(small_tmpfs / "ck"),
        ctx=single_process_context(),
        max_failed_saves=1,
        failed_saves_grace_s=0,
    )
    c.register("state", state)
    c.save(1)
    c.wait()
    state.t = torch.full((1_000_000,), 2.0)  # 4 MB does not
    c.save(2)
    with pytest.raises(CheckpointError, match="No space left on device"):
        c.wait()
    assert c.steps() == [1]
    assert not [p for p in (small_tmpfs / "ck").iterdir() if p.name.startswith(".tmp")]
    loaded = c.load()
    assert loaded is not None and loaded.step == 1 and torch.equal(state.t, torch.ones(100_000))
