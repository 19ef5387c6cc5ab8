"""Resumption acceptance tests of issue 3, with real worker processes and kill -9."""

from __future__ import annotations

import random
import signal
from collections import Counter, defaultdict
from pathlib import Path

import pytest
import torch
from train_support import Launcher, read_jsonl, wait_until


def _last_step(log: Path) -> int:
    steps = [r["step"] for r in read_jsonl(log) if "step" in r]
    return steps[-1] if steps else 0


def _assert_bitwise_equal(a: object, b: object, path: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), path
        for k in a:
            _assert_bitwise_equal(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_bitwise_equal(x, y, f"{path}/{i}")
    else:
        assert a == b, path


@pytest.mark.timeout(300)
def test_kill_9_at_random_steps_three_times_resumes_bitwise_identically(
    launcher: Launcher, tmp_path: Path
) -> None:
    steps = 60
    common = [
        "--steps",
        str(steps),
        "--ckpt-every",
        "5",
        "--global-batch",
        "48",
        "--micro-batch",
        "8",
    ]
    common += ["--dropout", "0.2", "--step-sleep", "0.03"]
    ref = launcher.start(
        2, [*common, "--ckpt-dir", str(tmp_path / "ref"), "--final-state", str(tmp_path / "ref.pt")]
    )
    assert ref.wait(150) == [0, 0], ref.output()

    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    ckpt = ["--ckpt-dir", str(tmp_path / "ck"), "--final-state", str(tmp_path / "final.pt")]
    kills = []
    for attempt in range(3):
        log = tmp_path / f"samples{attempt}"
        g = launcher.start(2, [*common, *ckpt, "--sample-log", str(log)], restart_count=attempt)
        # The file appears (opened for append) before its first line: wait for the line.
        wait_until(lambda log=log: read_jsonl(Path(f"{log}.rank0")), 120, "worker start")
        resume = next(r["resume"] for r in read_jsonl(Path(f"{log}.rank0")) if "resume" in r)
        target = rng.randint(resume + 2, min(resume + 15, steps - 3))
        wait_until(
            lambda log=log, t=target: _last_step(Path(f"{log}.rank0")) >= t, 120, f"step {target}"
        )
        victim = rng.randrange(2)
        g.procs[victim].send_signal(signal.SIGKILL)  # the crash
        g.kill()  # the launcher stops the survivors, as torchrun/flexrun do
        kills.append((resume, _last_step(Path(f"{log}.rank0")), victim))
    final = launcher.start(2, [*common, *ckpt], restart_count=3)
    assert final.wait(150) == [0, 0], final.output()

    a = torch.load(tmp_path / "ref.pt", weights_only=True)
    b = torch.load(tmp_path / "final.pt", weights_only=True)
    assert a["step"] == b["step"] == steps
    try:
        _assert_bitwise_equal(a["model"], b["model"], "model")
        _assert_bitwise_equal(a["optim"], b["optim"], "optim")
    except AssertionError as exc:
        raise AssertionError(
            f"not bitwise identical at {exc} (seed {seed}, kills {kills})"
        ) from None
    assert all(resume < killed for resume, killed, _ in kills), kills


def _committed_records(logs: list[Path]) -> dict[int, list[int]]:
    """Global sample ids per step, keeping only what the final timeline committed."""
    launches = []
    for log in logs:
        per_step: dict[int, list[int]] = defaultdict(list)
        resume = None
        for rank_file in sorted(log.parent.glob(log.name + ".rank*")):
            for r in read_jsonl(rank_file):
                if "resume" in r:
                    resume = r["resume"]
                else:
                    per_step[r["step"]].extend(r["ids"])
        launches.append((resume, per_step))
    committed: dict[int, list[int]] = {}
    for i, (_, per_step) in enumerate(launches):
        limit = launches[i + 1][0] if i + 1 < len(launches) else None
        for step, ids in per_step.items():
            if limit is None or step <= limit:
                committed[step] = sorted(ids)
    return committed


@pytest.mark.timeout(300)
def test_world_size_2_1_2_consumes_each_sample_once_and_matches_single_process(
    launcher: Launcher, tmp_path: Path
) -> None:
    steps, g = 70, 64
    common = [
        "--steps",
        str(steps),
        "--ckpt-every",
        "5",
        "--global-batch",
        str(g),
        "--micro-batch",
        "16",
    ]
    common += ["--dropout", "0", "--dtype", "float64", "--lr", "0.003"]
    ref = launcher.start(
        1,
        [
            *common,
            "--ckpt-dir",
            str(tmp_path / "ref"),
            "--final-state",
            str(tmp_path / "ref.pt"),
            "--sample-log",
            str(tmp_path / "ref-samples"),
        ],
    )
    assert ref.wait(150) == [0], ref.output()

    ckpt = ["--ckpt-dir", str(tmp_path / "ck"), "--final-state", str(tmp_path / "final.pt")]
    logs = [tmp_path / f"samples{i}" for i in range(3)]
    for i, (world, crash) in enumerate([(2, 23), (1, 47)]):
        grp = launcher.start(
            world, [*common, *ckpt, "--sample-log", str(logs[i]), "--crash-at-step", str(crash)]
        )
        codes = grp.wait(150)
        assert codes == [-signal.SIGKILL] * world, grp.output()
    last = launcher.start(2, [*common, *ckpt, "--sample-log", str(logs[2])])
    assert last.wait(150) == [0, 0], last.output()

    committed = _committed_records(logs)
    assert sorted(committed) == list(range(1, steps + 1))
    resumes = [
        next(r["resume"] for r in read_jsonl(Path(f"{log}.rank0")) if "resume" in r) for log in logs
    ]
    assert resumes[0] == 0 and 0 < resumes[1] < 23 and 23 <= resumes[2] < 47, resumes
    reference = _committed_records([tmp_path / "ref-samples"])
    assert committed == reference  # same global batches, step by step

    n = 1797
    by_epoch: dict[int, Counter[int]] = defaultdict(Counter)
    epoch_of_step = {
        r["step"]: r["epoch"]
        for r in read_jsonl(Path(f"{tmp_path / 'ref-samples'}.rank0"))
        if "step" in r
    }
    for step, ids in committed.items():
        by_epoch[epoch_of_step[step]].update(ids)
    full_epochs = [e for e in by_epoch if e < max(by_epoch)]
    assert full_epochs == [0, 1]
    for e in full_epochs:
        assert set(by_epoch[e]) == set(range(n)) and set(by_epoch[e].values()) == {1}, f"epoch {e}"
    assert set(by_epoch[max(by_epoch)].values()) == {1}

    a = torch.load(tmp_path / "ref.pt", weights_only=True)["model"]
    b = torch.load(tmp_path / "final.pt", weights_only=True)["model"]
    for k in a:
        rel = ((a[k] - b[k]).norm() / a[k].norm()).item()
        assert rel <= 1e-5, (k, rel)
