"""A checkpoint save the storage refuses (full disk, read-only, I/O error) must not stop
training: nothing torn is left, the previous checkpoint is untouched, the failure is an
event, the next save tries again, and only ``max_failed_saves`` failures in a row raise.

Each behaviour runs against a real full tmpfs (mounted here when the test may mount) and
against injected ``ENOSPC`` (everywhere)."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from flexrun.errors import CheckpointError
from flexrun.events import read_events
from flexrun.testing.clock import FakeClock
from flexrun.train import Checkpointer
from flexrun.train.commit import commit_checkpoint, verify_checkpoint
from flexrun.train.context import single_process_context
from flexrun.train.storage import LocalStorage, StorageFailure


class _InjectedStorage(LocalStorage):
    """Local storage whose file writes fail with ``code`` after 100 bytes while armed."""

    def __init__(self) -> None:
        self.code: int | None = None

    def write_file(self, path: str, writer: Any) -> tuple[int, str]:
        code = self.code
        if code is None:
            return super().write_file(path, writer)

        def failing(f: Any) -> None:
            f.write(b"x" * 100)
            raise OSError(code, os.strerror(code))

        return super().write_file(path, failing)


class Disk:
    """Where checkpoints go, and a way to make that storage full and free again."""

    def __init__(self, root: Path, storage: _InjectedStorage | None) -> None:
        self.root = root
        self.storage = storage
        self._ballast = root / "ballast"

    def fill(self) -> None:
        if self.storage is not None:
            self.storage.code = errno.ENOSPC
            return
        chunk = b"\0" * (64 << 10)
        with open(self._ballast, "ab", buffering=0) as fh:
            for _ in range(10_000):  # bounded: the tmpfs holds a few MiB
                try:
                    fh.write(chunk)
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC, exc
                    break
            else:
                raise AssertionError("the tmpfs never filled up")
        with pytest.raises(OSError):  # really full: not one more byte fits
            (self.root / "probe").write_bytes(b"x")
        (self.root / "probe").unlink(missing_ok=True)

    def free(self) -> None:
        if self.storage is not None:
            self.storage.code = None
        else:
            self._ballast.unlink()

    def checkpointer(self, directory: Path, run_dir: Path, **kw: Any) -> Checkpointer:
        ctx = single_process_context(run_dir=str(run_dir), round=kw.pop("round", 0))
        return Checkpointer(str(directory), ctx=ctx, storage=self.storage, **kw)


def _mount_tmpfs(mnt: Path, size: str = "2m") -> str | None:
    """Mount a tmpfs at ``mnt``; the reason when this machine does not allow it."""
    mnt.mkdir(parents=True)
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return None if r.returncode == 0 else (r.stderr.strip() or f"mount exited {r.returncode}")


def _umount(mnt: Path) -> None:
    subprocess.run(["umount", "-l", str(mnt)], check=True, timeout=30)


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / f"tmpfs-{uuid.uuid4().hex[:6]}"
    why = _mount_tmpfs(mnt)
    if why is not None:
        pytest.skip(f"cannot mount a tmpfs here ({why}); the injected variant runs instead")
    try:
        yield mnt
    finally:
        _umount(mnt)


@pytest.fixture(params=["injected", "tmpfs"])
def disk(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Disk]:
    if request.param == "injected":
        root = tmp_path / "disk"
        root.mkdir()
        yield Disk(root, _InjectedStorage())
    else:
        yield Disk(request.getfixturevalue("tmpfs"), None)


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = torch.nn.Linear(32, 16)
    return m, torch.optim.Adam(m.parameters(), lr=0.1)


def _train_step(m: torch.nn.Module, o: torch.optim.Optimizer) -> None:
    m(torch.randn(3, 32)).pow(2).sum().backward()
    o.step()
    o.zero_grad()


def _tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def _failures(run_dir: Path) -> list[dict[str, Any]]:
    return [e for e in read_events(run_dir) if e["event"] == "checkpoint_save_failed"]


@pytest.mark.timeout(60)
def test_a_save_on_a_full_disk_leaves_nothing_behind_and_keeps_the_previous_intact(
    disk: Disk, tmp_path: Path
) -> None:
    m, o = _model()
    ck, run = disk.root / "ck", tmp_path / "run"
    c = disk.checkpointer(ck, run)
    c.register("model", m)
    c.register("optim", o)
    _train_step(m, o)
    c.save(1, blocking=True)
    before = _tree(ck)
    first = m.weight.detach().clone()
    disk.fill()
    _train_step(m, o)
    c.save(2)  # background persist fails
    _train_step(m, o)
    c.save(3, blocking=True)  # foreground persist fails; neither raises
    assert c.failed_saves == 2
    assert _tree(ck) == before  # byte for byte: no partial file, nothing of step 1 touched
    failed = _failures(run)
    assert [(e["step"], e["reason"], e["consecutive"], e["fatal"]) for e in failed] == [
        (2, "ENOSPC", 1, False),
        (3, "ENOSPC", 2, False),
    ]
    disk.free()
    _train_step(m, o)
    latest = m.weight.detach().clone()
    c.save(4, blocking=True)  # the next save tries again and commits
    assert c.failed_saves == 0 and c.steps() == [1, 4]
    assert sorted(_tree(ck)) == sorted(
        {"fence.json", "latest", *before, *(n.replace("step_1", "step_4") for n in before)}
    )
    for step, want in ((1, first), (4, latest)):
        fresh = disk.checkpointer(ck, run)
        model, _ = _model()
        fresh.register("model", model)
        fresh.register("optim", torch.optim.Adam(model.parameters(), lr=0.1))
        loaded = fresh.load(step=step)
        assert loaded is not None and loaded.skipped == ()
        assert torch.equal(model.weight, want)
    c.close()


@pytest.mark.timeout(60)
def test_max_failed_saves_in_a_row_raise_and_a_committed_save_resets_the_count(
    disk: Disk, tmp_path: Path
) -> None:
    m, _ = _model()
    run = tmp_path / "run"
    c = disk.checkpointer(disk.root / "ck", run, max_failed_saves=2, failed_saves_grace_s=0)
    c.register("model", m)
    disk.fill()
    c.save(1)
    c.wait()  # a failure below the limit does not raise here either
    assert c.failed_saves == 1
    disk.free()
    c.save(2)
    c.wait()
    assert c.failed_saves == 0 and c.steps() == [2]
    disk.fill()
    c.save(3)
    c.wait()
    c.save(4)  # after failure 1 of 2: goes on
    with pytest.raises(CheckpointError, match=r"2 checkpoint saves in a row failed.*step 4"):
        c.save(5)  # failure 2 of 2, learned here: raises before saving
    assert [(e["step"], e["consecutive"], e["fatal"]) for e in _failures(run)] == [
        (1, 1, False),
        (3, 1, False),
        (4, 2, True),
    ]
    assert c.steps() == [2]
    disk.free()
    c.close()


@pytest.mark.timeout(60)
def test_a_foreground_save_raises_at_once_when_it_reaches_the_limit(
    disk: Disk, tmp_path: Path
) -> None:
    m, _ = _model()
    c = disk.checkpointer(
        disk.root / "ck", tmp_path / "run", max_failed_saves=1, failed_saves_grace_s=0
    )
    c.register("model", m)
    disk.fill()
    with pytest.raises(CheckpointError, match="No space left on device"):
        c.save(1, blocking=True)
    disk.free()
    c.save(2, blocking=True)
    assert c.steps() == [2]
    with pytest.raises(CheckpointError, match="max_failed_saves"):
        disk.checkpointer(disk.root / "ck2", tmp_path / "run", max_failed_saves=0)


@pytest.mark.timeout(60)
def test_a_checkpointer_built_on_a_full_disk_claims_the_fence_at_the_first_save(
    disk: Disk, tmp_path: Path
) -> None:
    m, _ = _model()
    ck, run = disk.root / "ck", tmp_path / "run"
    disk.fill()
    c = disk.checkpointer(ck, run, round=4)  # a restarted worker during the window
    c.register("model", m)
    deferred = [e for e in read_events(run) if e["event"] == "checkpoint_fence_deferred"]
    assert len(deferred) == 1 and deferred[0]["reason"] == "ENOSPC"
    assert not (ck / "fence.json").exists()
    c.save(1, blocking=True)  # fence still unclaimable: this save fails, training goes on
    assert c.failed_saves == 1 and c.steps() == []
    disk.free()
    c.save(2, blocking=True)
    fence = json.loads((ck / "fence.json").read_text())
    assert fence["round"] == 4 and fence["generation"] == 4 and fence["run"] == "local"
    assert c.steps() == [2] and sorted(p.name for p in ck.iterdir()) == [
        "fence.json",
        "latest",
        "step_2",
    ]
    with pytest.raises(CheckpointError, match="round 4"):  # fencing still holds
        disk.checkpointer(ck, run, round=3)
    c.close()


@pytest.mark.timeout(60)
def test_a_read_only_filesystem_fails_the_save_with_erofs_and_the_next_one_commits(
    tmpfs: Path, tmp_path: Path
) -> None:
    m, _ = _model()
    run = tmp_path / "run"
    c = Checkpointer(str(tmpfs / "ck"), ctx=single_process_context(run_dir=str(run)))
    c.register("model", m)
    c.save(1, blocking=True)
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True, timeout=30)
    try:
        c.save(2, blocking=True)
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(tmpfs)], check=True, timeout=30)
    assert [(e["step"], e["reason"]) for e in _failures(run)] == [(2, "EROFS")]
    c.save(3, blocking=True)
    assert c.steps() == [1, 3] and c.failed_saves == 0
    c.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("code", "storage_failure"),
    [(errno.ENOSPC, True), (errno.EDQUOT, True), (errno.EIO, True), (errno.EACCES, False)],
)
def test_a_failed_write_removes_its_partial_file(
    tmp_path: Path, code: int, storage_failure: bool
) -> None:
    path = tmp_path / "model.pt"

    def writer(f: Any) -> None:
        f.write(b"y" * 5000)
        raise OSError(code, os.strerror(code))

    with pytest.raises(CheckpointError, match=os.strerror(code)) as info:
        LocalStorage().write_file(str(path), writer)
    assert isinstance(info.value, StorageFailure) is storage_failure
    assert not path.exists() and list(tmp_path.iterdir()) == []


class _FailingRename(LocalStorage):
    """Renames whose destination (or source) ends with ``suffix`` fail with EIO while armed."""

    def __init__(self) -> None:
        self.suffix: str | None = None

    def rename(self, src: str, dst: str, *, replace: bool) -> None:
        if self.suffix is not None and (
            dst.endswith(self.suffix) or Path(src).name.startswith(self.suffix)
        ):
            raise StorageFailure(f"checkpoint rename failed for {src}: I/O error", errno.EIO)
        super().rename(src, dst, replace=replace)


@pytest.mark.timeout(30)
def test_a_pointer_update_that_fails_after_the_rename_withdraws_the_new_checkpoint(
    tmp_path: Path,
) -> None:
    m, o = _model()
    storage = _FailingRename()
    run = tmp_path / "run"
    c = Checkpointer(
        str(tmp_path / "ck"), ctx=single_process_context(run_dir=str(run)), storage=storage
    )
    c.register("model", m)
    c.save(1, blocking=True)
    before = _tree(tmp_path / "ck")
    storage.suffix = "/latest"
    _train_step(m, o)
    c.save(2, blocking=True)  # reported failed: so step_2 must not stay visible
    assert [(e["step"], e["reason"]) for e in _failures(run)] == [(2, "EIO")]
    assert c.steps() == [1] and _tree(tmp_path / "ck") == before
    c.close()


@pytest.mark.timeout(30)
def test_a_failed_re_save_of_a_step_puts_the_previous_one_back(tmp_path: Path) -> None:
    storage = _FailingRename()
    root = str(tmp_path)

    def commit(payload: bytes) -> None:
        commit_checkpoint(
            storage, root, step=5, round=0, world_size=1, files={"a.pt": lambda f: f.write(payload)}
        )

    commit(b"first")
    storage.suffix = ".tmp-"  # the staged directory cannot be moved into place
    with pytest.raises(StorageFailure):
        commit(b"second")
    _, blobs = verify_checkpoint(storage, root, 5)
    assert blobs == {"a.pt": b"first"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_5"]


@pytest.mark.timeout(60)
def test_failed_saves_raise_only_once_they_span_the_grace(disk: Disk, tmp_path: Path) -> None:
    """Frequent checkpoints on a disk full for seconds: the count alone would end the run."""
    m, _ = _model()
    run = tmp_path / "run"
    clock = FakeClock()
    c = disk.checkpointer(
        disk.root / "ck", run, max_failed_saves=3, failed_saves_grace_s=60.0, clock=clock
    )
    c.register("model", m)
    c.save(1, blocking=True)
    disk.fill()
    for step in (2, 3, 4, 5):  # four failures in 30 s: past the count, inside the grace
        c.save(step, blocking=True)
        clock.advance(10.0)
    assert c.failed_saves == 4
    clock.advance(30.0)  # the streak is now 70 s old
    with pytest.raises(CheckpointError, match=r"5 checkpoint saves in a row failed over 70 s"):
        c.save(6, blocking=True)
    assert [(e["step"], e["failing_s"], e["fatal"]) for e in _failures(run)] == [
        (2, 0.0, False),
        (3, 10.0, False),
        (4, 20.0, False),
        (5, 30.0, False),
        (6, 70.0, True),
    ]
    disk.free()
    assert c.steps() == [1]  # nothing saved before was lost
    c.close()
