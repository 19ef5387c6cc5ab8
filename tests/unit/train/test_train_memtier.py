"""The checkpoint memory tier in one process: which saves are durable, which copy loads,
corrupted copies skipped, the cap and the missing directory turning the tier off."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from flexrun.errors import CheckpointError
from flexrun.events import read_events
from flexrun.train import Checkpointer, memsave
from flexrun.train.context import single_process_context
from flexrun.train.memload import decode, newest_valid, verify_blob
from flexrun.train.memsave import TRAILER, copy_steps, write_copy


def _model(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = torch.nn.Linear(6, 4)
    return m, torch.optim.Adam(m.parameters(), lr=0.1)


def _step(m: torch.nn.Module, o: torch.optim.Optimizer) -> None:
    m(torch.randn(3, 6)).pow(2).sum().backward()
    o.step()
    o.zero_grad()


def _ckpt(tmp: Path, m: torch.nn.Module, o: torch.optim.Optimizer, **kw: Any) -> Checkpointer:
    ctx = single_process_context(run_dir=str(tmp / "run"))
    kw.setdefault("memory_dir", str(tmp / "shm"))
    c = Checkpointer(tmp / "ck", ctx=ctx, durable_every=5, **kw)
    c.register("model", m)
    c.register("optim", o)
    return c


def _events(tmp: Path, name: str) -> list[dict[str, Any]]:
    return [e for e in read_events(tmp / "run") if e["event"] == name]


def _train(tmp: Path, steps: int, **kw: Any) -> tuple[Checkpointer, dict[int, Any]]:
    """Save every step; returns the checkpointer and each step's model state."""
    m, o = _model()
    c = _ckpt(tmp, m, o, **kw)
    states = {}
    for s in range(1, steps + 1):
        _step(m, o)
        c.save(s, extra={"step": s})
        states[s] = {k: v.clone() for k, v in m.state_dict().items()}
    c.close()
    return c, states


def _copies(tmp: Path) -> list[Path]:
    return sorted((tmp / "shm").glob("ckpt-*/step_*.mem"))


def test_every_save_stages_a_memory_copy_and_every_fifth_step_is_durable(tmp_path: Path) -> None:
    c, _ = _train(tmp_path, 12)
    # The first save is durable (nothing durable yet), then at least every 5 steps.
    assert c.steps() == [1, 6, 11]
    assert [p.name for p in _copies(tmp_path)] == ["step_11.mem", "step_12.mem"]


def test_load_takes_the_newest_memory_copy_bitwise(tmp_path: Path) -> None:
    _, states = _train(tmp_path, 9)
    m, o = _model(seed=1)
    got = _ckpt(tmp_path, m, o).load()
    assert got is not None and got.step == 9 and got.extra == {"step": 9}
    for k, v in m.state_dict().items():
        assert torch.equal(v, states[9][k])
    loaded = _events(tmp_path, "checkpoint_loaded")
    assert loaded[-1]["restored_from"] == "memory" and loaded[-1]["step"] == 9


def test_a_flipped_byte_skips_that_copy_and_the_one_before_loads(tmp_path: Path) -> None:
    _, states = _train(tmp_path, 8)
    newest = _copies(tmp_path)[-1]
    blob = bytearray(newest.read_bytes())
    blob[len(blob) // 3] ^= 0x10
    newest.write_bytes(bytes(blob))
    m, o = _model(seed=1)
    got = _ckpt(tmp_path, m, o).load()
    assert got is not None and got.step == 7
    for k, v in m.state_dict().items():
        assert torch.equal(v, states[7][k])
    skipped = _events(tmp_path, "checkpoint_memory_skipped")
    assert [e["step"] for e in skipped] == [8] and "checksum mismatch" in skipped[0]["reason"]


def test_a_newer_durable_checkpoint_wins_over_an_older_memory_copy(tmp_path: Path) -> None:
    _train(tmp_path, 4)
    m, o = _model()
    c = _ckpt(tmp_path, m, o)
    c.save(20, blocking=True)  # durable (blocking), and a memory copy of 20
    c.close()
    for p in _copies(tmp_path):
        p.unlink()
    m2, o2 = _model(seed=3)
    got = _ckpt(tmp_path, m2, o2).load()
    assert got is not None and got.step == 20
    assert _events(tmp_path, "checkpoint_loaded")[-1]["restored_from"] == "durable"


def test_a_state_over_the_cap_turns_the_tier_off_once_and_durable_saves_go_on(
    tmp_path: Path,
) -> None:
    c, _ = _train(tmp_path, 12, memory_max_bytes=100)
    assert _copies(tmp_path) == []
    off = _events(tmp_path, "checkpoint_memory_off")
    assert len(off) == 1 and "memory_max_bytes=100" in off[0]["reason"]
    assert c.steps() == [1, 6, 11]


def test_without_a_memory_directory_the_tier_is_off_and_says_so(tmp_path: Path) -> None:
    c, _ = _train(tmp_path, 7, memory_dir=None)
    off = _events(tmp_path, "checkpoint_memory_off")
    assert len(off) == 1 and "FLEXRUN_MEMORY_DIR" in off[0]["reason"]
    assert c.steps() == [1, 6]


def test_after_a_load_from_memory_the_next_durable_save_counts_from_the_durable_step(
    tmp_path: Path,
) -> None:
    _train(tmp_path, 8)  # durable 1, 6; memory 7, 8
    m, o = _model()
    c = _ckpt(tmp_path, m, o)
    assert c.load() is not None
    for s in range(9, 13):
        _step(m, o)
        c.save(s)
    c.close()
    assert c.steps() == [1, 6, 11]


def test_copies_verify_their_trailer(tmp_path: Path) -> None:
    write_copy(tmp_path, 3, {"x": torch.arange(1000)})
    inode = (tmp_path / "step_3.mem").stat().st_ino
    write_copy(tmp_path, 4, {"x": torch.arange(11)})
    write_copy(tmp_path, 5, {"x": torch.arange(12)})
    assert copy_steps(tmp_path) == [4, 5]  # the newest two are kept
    # Step 5 overwrote step 3's (larger) file in place, and verifies.
    assert (tmp_path / "step_5.mem").stat().st_ino == inode
    blob = (tmp_path / "step_5.mem").read_bytes()
    assert torch.equal(decode(blob, what="c")["x"], torch.arange(12))
    with pytest.raises(CheckpointError, match="truncated"):
        verify_blob(blob[:10], what="c")
    with pytest.raises(CheckpointError, match="bad trailer"):
        verify_blob(blob[:-1], what="c")
    with pytest.raises(CheckpointError, match="expected"):
        verify_blob(blob[1:], what="c")
    (tmp_path / "step_5.mem").write_bytes(blob[: -TRAILER.size - 1] + blob[-TRAILER.size :])
    skipped: list[int] = []
    found = newest_valid(tmp_path, lambda s, _why: skipped.append(s))
    assert found is not None and found[0] == 4 and skipped == [5]


def test_a_copy_written_in_pieces_checks_every_byte_of_every_piece(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (the writer hashes and writes a tensor's bytes a piece at a time: no piece may be missed)
    monkeypatch.setattr(memsave, "_PIECE", 64)
    state = {"x": torch.arange(1000, dtype=torch.float64), "y": torch.ones(3, 5)}
    size = write_copy(tmp_path, 1, state)
    blob = (tmp_path / "step_1.mem").read_bytes()
    assert size == len(blob) > 8000 + TRAILER.size
    got = decode(blob, what="c")
    assert torch.equal(got["x"], state["x"]) and torch.equal(got["y"], state["y"])
    for at in (0, 64, 4000, 4095, len(blob) - TRAILER.size - 1):  # (first, later, last piece)
        bad = bytearray(blob)
        bad[at] ^= 0x01
        with pytest.raises(CheckpointError, match="checksum mismatch"):
            verify_blob(bytes(bad), what="c")


def test_durable_every_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="durable_every"):
        Checkpointer(tmp_path, ctx=single_process_context(), durable_every=0)


def test_a_memory_filesystem_that_fails_turns_the_tier_off_and_training_goes_on(
    tmp_path: Path,
) -> None:
    import shutil

    m, o = _model()
    c = _ckpt(tmp_path, m, o)
    _step(m, o)
    c.save(1)
    c.wait()
    shutil.rmtree(tmp_path / "shm")  # the memory directory vanished (ENOENT on write)
    for s in range(2, 8):
        _step(m, o)
        c.save(s)
    c.close()
    off = _events(tmp_path, "checkpoint_memory_off")
    assert len(off) == 1 and "memory copy failed" in off[0]["reason"], off
    assert c.steps() == [1, 6]
