"""FSDP2 (``fully_shard``) model and raw Adam registered as they are with
ShardedCheckpointer: a kill -9 and resume ends bitwise where the uninterrupted run ends,
and a 2-worker checkpoint loads at 1 worker with the same model and optimizer state."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch
from train_support import HERE, Launcher, wait_until

WORKER = HERE / "fsdp2_worker.py"


def _run(launcher: Launcher, world: int, root: Path, stop: int, saves: str, out: Path) -> dict:
    grp = launcher.start(world, [str(root), str(stop), saves, str(out)], script=WORKER)
    assert grp.wait(180) == [0] * world, grp.output()
    return torch.load(out, weights_only=True)


def _assert_same(got: dict, want: dict) -> None:
    assert got["params"].keys() == want["params"].keys()
    for k, v in want["params"].items():
        assert torch.equal(got["params"][k], v), k
    assert got["optim_state"].keys() == want["optim_state"].keys()
    assert want["optim_state"], "the reference run has no optimizer state"
    for k, per_param in want["optim_state"].items():
        for name, v in per_param.items():
            assert torch.equal(got["optim_state"][k][name], v), (k, name)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_kill9_and_resume_ends_bitwise_like_the_uninterrupted_run(
    launcher: Launcher, tmp_path: Path, mode: str
) -> None:
    ref = _run(launcher, 2, tmp_path / "ref", 6, "", tmp_path / "ref.pt")
    root = tmp_path / "ck"
    # Runs on past step 3 until killed (async: training goes on while step 3 is written);
    # the resume starts from the committed step 3.
    args = [str(root), "1000000", "3", str(tmp_path / "x.pt")] + (
        ["async"] if mode == "async" else []
    )
    first = launcher.start(2, args, script=WORKER)
    wait_until(lambda: (root / "step_3" / "manifest.json").exists(), 180, "step 3 committed")
    first.kill(signal.SIGKILL)
    got = _run(launcher, 2, root, 6, "", tmp_path / "resumed.pt")
    assert got["start"] == 3
    assert got["state_after_load"] > 0, "optimizer state empty after load"
    _assert_same(got, ref)


@pytest.mark.timeout(600)
def test_checkpoint_of_2_workers_loads_at_1_with_model_and_optimizer_state(
    launcher: Launcher, tmp_path: Path
) -> None:
    root = tmp_path / "ck"
    saved = _run(launcher, 2, root, 4, "4", tmp_path / "saved.pt")
    loaded = _run(launcher, 1, root, 4, "", tmp_path / "loaded.pt")
    assert loaded["start"] == 4
    assert loaded["state_after_load"] > 0, "optimizer state empty after load"
    _assert_same(loaded, saved)
