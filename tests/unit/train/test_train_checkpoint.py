from __future__ import annotations

import errno
import json
import os
import random
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from flexrun.errors import CheckpointError
from flexrun.events import EventLog, read_events
from flexrun.train import Checkpointer, FencedError
from flexrun.train.commit import COMMIT_STAGES, RenameCommit, select_retained
from flexrun.train.commit_object import ObjectCommit
from flexrun.train.context import single_process_context
from flexrun.train.storage import LocalStorage


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = torch.nn.Linear(6, 4)
    o = torch.optim.Adam(m.parameters(), lr=0.1)
    m(torch.randn(3, 6)).sum().backward()
    o.step()
    return m, o


def _ckpt(directory: str, run_dir: Path | None = None, round: int = 0, **kw: Any) -> Checkpointer:
    ctx = single_process_context(run_dir=str(run_dir) if run_dir else None, round=round)
    return Checkpointer(directory, ctx=ctx, **kw)


def flip_a_byte(c: Checkpointer, step: int, name: str) -> None:
    """Corrupt one data file of a committed checkpoint in place, on any storage."""
    proto = c._proto
    manifest = proto.read_manifest(step)
    blob = bytearray(b"".join(proto.read_chunks(step, manifest, name)))
    blob[len(blob) // 2] ^= 0x01
    if isinstance(proto, RenameCommit):
        Path(proto.path(f"step_{step}", name)).write_bytes(bytes(blob))
    else:
        assert isinstance(proto, ObjectCommit)
        key = proto.store.join(proto.root, f"step_{step}", manifest.data_dir, name)
        proto.store.put(key, bytes(blob))


def _train_step(m: torch.nn.Module, o: torch.optim.Optimizer) -> None:
    m(torch.randn(3, 6)).pow(2).sum().backward()
    o.step()
    o.zero_grad()


@pytest.fixture(params=["local", "memory"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "local":
        return str(tmp_path / "ck")
    return f"memory://ck-{uuid.uuid4().hex}"


def test_save_then_load_restores_state_extra_and_writes_a_manifest(where: str) -> None:
    m, o = _model()
    c = _ckpt(where)
    c.register("model", m)
    c.register("optim", o)
    c.save(7, extra={"epoch": 2})
    c.wait()
    expected = {k: v.clone() for k, v in m.state_dict().items()}
    _train_step(m, o)
    loaded = c.load()
    assert loaded is not None and loaded.step == 7 and loaded.extra == {"epoch": 2}
    for k, v in m.state_dict().items():
        assert torch.equal(v, expected[k])
    assert c.steps() == [7]
    if where.startswith("/"):
        man = json.loads((Path(where) / "step_7" / "manifest.json").read_text())
        assert man["format_version"] == 1 and man["step"] == 7 and man["world_size"] == 1
        assert set(man["files"]) == {"model.pt", "optim.pt", "extra.pt", "rng.pt"}
        assert all(len(f["sha256"]) == 64 and f["size"] > 0 for f in man["files"].values())
        assert man["flexrun_version"] and man["created"] > 0
        assert (Path(where) / "latest").read_text() == "step_7"


def test_async_save_copies_state_before_returning(tmp_path: Path) -> None:
    m, o = _model()
    c = _ckpt(str(tmp_path))
    c.register("model", m)
    before = m.weight.detach().clone()
    c.save(1)
    with torch.no_grad():
        m.weight.add_(1.0)  # training continues while the persist runs
    c.wait()
    c.load()
    assert torch.equal(m.weight, before)


def test_flipped_byte_falls_back_to_previous_and_logs_why(tmp_path: Path, where: str) -> None:
    m, o = _model()
    run_dir = tmp_path / "run"
    c = _ckpt(where, run_dir=run_dir)
    c.register("model", m)
    c.save(1)
    c.wait()
    good = m.weight.detach().clone()
    _train_step(m, o)
    c.save(2)
    c.wait()
    flip_a_byte(c, 2, "model.pt")
    loaded = c.load()
    assert loaded is not None and loaded.step == 1 and loaded.skipped == (2,)
    assert torch.equal(m.weight, good)
    events = list(read_events(run_dir))
    fb = [e for e in events if e["event"] == "checkpoint_fallback"]
    assert fb and fb[0]["step"] == 2 and "sha256 mismatch" in fb[0]["reason"]
    assert [e["step"] for e in events if e["event"] == "checkpoint_loaded"] == [1]


def test_missing_manifest_or_file_is_skipped(tmp_path: Path) -> None:
    m, _ = _model()
    c = _ckpt(str(tmp_path))
    c.register("model", m)
    for s in (1, 2, 3):
        c.save(s)
    c.wait()
    (tmp_path / "step_3" / "manifest.json").unlink()
    (tmp_path / "step_2" / "model.pt").unlink()
    loaded = c.load()
    assert loaded is not None and loaded.step == 1 and loaded.skipped == (3, 2)


class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (self.marker,))


def test_a_pickle_that_runs_code_is_refused(tmp_path: Path) -> None:
    m, _ = _model()
    run_dir = tmp_path / "run"
    root = tmp_path / "ck"
    c = _ckpt(str(root), run_dir=run_dir)
    c.register("model", m)
    c.save(1)
    c.wait()
    marker = tmp_path / "pwned"
    # A step_2 whose manifest verifies but whose model.pt would call os.mkdir on load.
    from flexrun.train.commit import commit_checkpoint

    commit_checkpoint(
        LocalStorage(),
        str(root),
        step=2,
        round=0,
        world_size=1,
        files={
            "model.pt": lambda f: torch.save({"weight": _Evil(str(marker))}, f),
            "extra.pt": lambda f: torch.save({}, f),
        },
    )
    loaded = c.load()
    assert not marker.exists()
    assert loaded is not None and loaded.step == 1
    fb = [e for e in read_events(run_dir) if e["event"] == "checkpoint_fallback"]
    assert "weights_only" in fb[0]["reason"]
    with pytest.raises(CheckpointError, match="weights_only"):
        c.load(step=2)
    assert not marker.exists()
    # The payload is real: loading it the unsafe way does run code.
    torch.load(root / "step_2" / "model.pt", weights_only=False)
    assert marker.exists()


class _NoSpaceStorage(LocalStorage):
    """Local storage whose data writes hit ENOSPC after some bytes, when armed."""

    armed = False

    def write_file(self, path: str, writer: Any) -> tuple[int, str]:
        if not self.armed or not path.endswith(".pt"):
            return super().write_file(path, writer)

        def failing(f: Any) -> None:
            f.write(b"x" * 100)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        return super().write_file(path, failing)


def test_disk_full_during_async_save_keeps_previous_reports_and_training_goes_on(
    tmp_path: Path,
) -> None:
    m, o = _model()
    storage = _NoSpaceStorage()
    run_dir = tmp_path / "run"
    c = Checkpointer(
        str(tmp_path / "ck"), ctx=single_process_context(run_dir=str(run_dir)), storage=storage
    )
    c.register("model", m)
    c.save(1)
    c.wait()
    good = m.weight.detach().clone()
    storage.armed = True
    _train_step(m, o)
    c.save(2)  # returns: the failure happens in the background
    c.save(3)  # does not raise either: 2 failures in a row, the limit is 3
    c.wait()
    assert c.failed_saves == 2
    assert c.steps() == [1]
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["fence.json", "latest", "step_1"]
    failed = [e for e in read_events(run_dir) if e["event"] == "checkpoint_save_failed"]
    assert [(e["step"], e["reason"], e["consecutive"], e["fatal"]) for e in failed] == [
        (2, "ENOSPC", 1, False),
        (3, "ENOSPC", 2, False),
    ]
    assert "No space" in failed[0]["error"]
    storage.armed = False
    c.save(4)
    c.wait()
    assert c.failed_saves == 0
    loaded = c.load(step=1)
    assert loaded is not None and loaded.step == 1 and torch.equal(m.weight, good)
    c.close()
    assert c.steps() == [1, 4]


@pytest.mark.parametrize("stage", COMMIT_STAGES)
def test_failure_at_any_commit_stage_leaves_a_complete_checkpoint(
    tmp_path: Path, stage: str
) -> None:
    m, o = _model()

    def hook(s: str) -> None:
        if s == stage:
            raise RuntimeError(f"injected at {s}")

    c = _ckpt(str(tmp_path), fault_hook=None)
    c.register("model", m)
    c.save(1)
    c.wait()
    first = m.weight.detach().clone()
    _train_step(m, o)
    second = m.weight.detach().clone()
    c._p._fault_hook = hook
    c.save(2)
    with pytest.raises(CheckpointError, match="injected"):
        c.wait()
    c._p._fault_hook = None
    fresh = _ckpt(str(tmp_path))
    fresh.register("model", m)
    loaded = fresh.load()
    assert loaded is not None and loaded.skipped == ()
    assert torch.equal(m.weight, first if loaded.step == 1 else second)
    assert loaded.step == (2 if COMMIT_STAGES.index(stage) >= COMMIT_STAGES.index("renamed") else 1)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]


def test_straggler_from_an_older_round_is_fenced(tmp_path: Path) -> None:
    m, _ = _model()
    old = _ckpt(str(tmp_path), round=1)
    old.register("model", m)
    old.save(10)
    old.wait()
    new = _ckpt(str(tmp_path), round=2)  # the new round claims the directory
    new.register("model", m)
    new.save(10)  # the new round re-saves step 10
    new.wait()
    old.save(11)
    with pytest.raises(CheckpointError, match="round 2"):
        old.wait()
    assert new.steps() == [10]
    man = json.loads((tmp_path / "step_10" / "manifest.json").read_text())
    assert man["round"] == 2
    with pytest.raises(FencedError):
        _ckpt(str(tmp_path), round=1)


def test_retention_keeps_last_n_and_every_kth(tmp_path: Path) -> None:
    m, _ = _model()
    c = _ckpt(str(tmp_path), keep_last=2, keep_every=4)
    c.register("model", m)
    for s in range(1, 10):
        c.save(s)
    c.close()
    assert c.steps() == [4, 8, 9]
    assert select_retained([3], keep_last=1, keep_every=None) == {3}


def test_rng_states_are_restored(tmp_path: Path) -> None:
    m, _ = _model()
    c = _ckpt(str(tmp_path))
    c.register("model", m)
    torch.manual_seed(1)
    np.random.seed(1)
    random.seed(1)
    c.save(1, blocking=True)
    first = (torch.rand(3), np.random.rand(3), random.random())
    torch.manual_seed(99)
    np.random.seed(99)
    random.seed(99)
    c.load()
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert (
        torch.equal(first[0], again[0])
        and np.array_equal(first[1], again[1])
        and first[2] == again[2]
    )


def test_stale_staging_of_crashed_writers_is_removed(tmp_path: Path) -> None:
    stale = tmp_path / ".tmp-step_5-r0-0123456789ab"
    stale.mkdir(parents=True)
    (stale / "model.pt").write_bytes(b"partial")
    _ckpt(str(tmp_path))
    assert not stale.exists()


def test_load_with_no_checkpoint_returns_none_and_nothing_verifying_raises(tmp_path: Path) -> None:
    m, _ = _model()
    c = _ckpt(str(tmp_path))
    c.register("model", m)
    assert c.load() is None
    c.save(1, blocking=True)
    (tmp_path / "step_1" / "model.pt").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="no checkpoint"):
        c.load()


def test_saved_event_reports_step_bytes_stall_and_persist(tmp_path: Path) -> None:
    m, _ = _model()
    log = EventLog(tmp_path / "run", run_id="r", node="n")
    c = Checkpointer(str(tmp_path / "ck"), ctx=single_process_context(round=3), events=log)
    c.register("model", m)
    c.save(5)
    c.close()
    (ev,) = [e for e in read_events(tmp_path / "run") if e["event"] == "checkpoint_saved"]
    assert ev["step"] == 5 and ev["bytes"] > 0 and ev["round"] == 3
    assert ev["stall_s"] >= 0 and ev["persist_s"] >= 0


def test_bad_names_and_closed_checkpointer_are_rejected(tmp_path: Path) -> None:
    m, _ = _model()
    c = _ckpt(str(tmp_path))
    with pytest.raises(CheckpointError):
        c.register("a/b", m)
    c.register("model", m)
    with pytest.raises(CheckpointError):
        c.register("model", m)
    c.close()
    with pytest.raises(CheckpointError):
        c.save(1)


def test_deferred_copy_holds_the_next_optimizer_step_until_state_is_copied(tmp_path: Path) -> None:
    m, o = _model()
    c = _ckpt(str(tmp_path))
    c.register("model", m)
    c.register("optim", o)
    w_before = m.weight.detach().clone()
    exp_avg_before = o.state[m.weight]["exp_avg"].clone()
    c.save(1)  # parameters and Adam state are copied in the background
    _train_step(m, o)  # the optimizer step waits for that copy
    assert not torch.equal(m.weight, w_before)
    c.wait()
    assert c.last_stall_s >= 0
    c.load()
    assert torch.equal(m.weight, w_before)
    assert torch.equal(o.state[m.weight]["exp_avg"], exp_avg_before)


def test_throttled_background_persist_sleeps_on_the_injected_clock(tmp_path: Path) -> None:
    from flexrun.testing import FakeClock

    clock = FakeClock()
    big = _BigState()
    c = Checkpointer(
        str(tmp_path),
        ctx=single_process_context(),
        clock=clock,
        persist_max_bytes_s=1_000_000.0,
        persist_cpu_share=None,  # the rate cap alone
        save_rng=False,
    )
    c.register("big", big)
    start = clock.monotonic()
    c.save(1)
    c.wait()
    assert 3.9 <= clock.monotonic() - start <= 4.5  # ~4 MB at 1 MB/s, on the fake clock
    c.load()
    assert torch.equal(big.t, torch.ones(1_000_000))


class _BigState:
    def __init__(self) -> None:
        self.t = torch.ones(1_000_000)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"t": self.t}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.t = state["t"]
