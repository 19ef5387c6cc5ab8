"""A full checkpoint disk does not stop a real job: a 2-node restart-mode job trains
through a window of failed saves (a real full tmpfs, or chaos's injected ENOSPC) with no
worker failing, later saves commit, and the final weights equal the reference run's.
And when saves keep failing, every rank raises at the same step (none is left waiting)."""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest
from support import wait_for
from train_support import HERE, Launcher

from flexrun.testing import invariants as inv
from flexrun.testing.chaos import ChaosJob, JobSpec, check


def _mount_tmpfs(mnt: Path) -> str | None:
    mnt.mkdir(parents=True)
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return None if r.returncode == 0 else (r.stderr.strip() or f"mount exited {r.returncode}")


class _Window:
    """Makes the job's checkpoint storage full, then free again."""

    def __init__(self, job: ChaosJob, tmpfs: Path | None) -> None:
        self.flag = job.root / "enospc"  # the workload's injected-ENOSPC switch
        self.tmpfs = tmpfs

    def fill(self) -> None:
        if self.tmpfs is None:
            self.flag.write_text("test: checkpoint writes fail with ENOSPC\n")
            return
        with open(self.tmpfs / "ballast", "ab", buffering=0) as fh:
            for _ in range(1000):  # bounded: 4 MiB fill up in 64 pieces
                try:
                    fh.write(b"\0" * (64 << 10))
                except OSError:
                    break

    def free(self) -> None:
        if self.tmpfs is None:
            self.flag.unlink()
        else:
            (self.tmpfs / "ballast").unlink()


def _events(job: ChaosJob, name: str) -> list[dict[str, Any]]:
    return [e for e in inv.read_events(job.root / "runs") if e.get("event") == name]


@pytest.mark.timeout(420)
@pytest.mark.parametrize("disk", ["injected", "tmpfs"])
def test_a_restart_mode_job_trains_through_a_full_disk_window(tmp_path: Path, disk: str) -> None:
    root = tmp_path / "job"
    root.mkdir()
    tmpfs: Path | None = None
    if disk == "tmpfs":
        tmpfs = tmp_path / f"tmpfs-{uuid.uuid4().hex[:6]}"
        why = _mount_tmpfs(tmpfs)
        if why is not None:
            pytest.skip(f"cannot mount a tmpfs here ({why}); the injected variant covers it")
        (tmpfs / "ckpt").mkdir()
        (root / "ckpt").symlink_to(tmpfs / "ckpt")
    spec = JobSpec(root=root, launcher="restart", nodes=2, max_nodes=2, steps=120, step_sleep=0.15)
    job = ChaosJob(spec)
    try:
        _run_through_window(job, _Window(job, tmpfs))
    finally:
        if tmpfs is not None:  # after the checks: they read the checkpoints on it
            subprocess.run(["umount", "-l", str(tmpfs)], check=True, timeout=30)


def _run_through_window(job: ChaosJob, window: _Window) -> None:
    spec = job.spec
    try:
        job.start()
        wait_for(lambda: len(_events(job, "checkpoint_saved")) >= 2, 180, "two saved checkpoints")
        window.fill()
        # Two failed saves (the limit is 3); ten steps of at least 0.15 s each pass before
        # the next save, so freeing the disk now ends the window before a third.
        wait_for(
            lambda: job.poll() or len(_events(job, "checkpoint_save_failed")) >= 2,
            60,
            "two failed saves",
        )
        window.free()
        wait_for(job.poll, 180, "the job to finish")
    finally:
        job.stop()
    failed = _events(job, "checkpoint_save_failed")
    assert len(failed) == 2, failed
    assert {(e["reason"], e["fatal"]) for e in failed} == {("ENOSPC", False)}
    assert [e["consecutive"] for e in failed] == [1, 2]
    failed_steps = [int(e["step"]) for e in failed]
    saved_after = [
        e["step"] for e in _events(job, "checkpoint_saved") if e["step"] > max(failed_steps)
    ]
    assert saved_after and max(saved_after) == spec.steps  # later saves commit again
    assert _events(job, "failure") == []
    exits = _events(job, "worker_exited")
    assert exits and {e["exit_code"] for e in exits} == {0}, exits
    # The processes that hit the full disk are the ones that finished: no restart.
    steps = inv.read_step_logs(job.root / "steps")
    during = {r["pid"] for r in steps if r.get("step") == max(failed_steps)}
    finished = {r["pid"] for r in steps if r.get("step") == spec.steps}
    assert during and during == finished, (during, finished)
    result = check(job, [])
    assert result.ok, json.dumps(result.to_dict(), indent=1)
    assert {"final_weights", "checkpoints_intact", "exactly_once"} <= set(result.checked)


@pytest.mark.timeout(120)
def test_when_saves_keep_failing_every_rank_raises_at_the_same_step(
    launcher: Launcher, tmp_path: Path
) -> None:
    flag = tmp_path / "enospc"
    flag.write_text("full\n")
    g = launcher.start(
        2,
        [str(tmp_path / "ck"), str(flag), "2", "20"],
        script=HERE / "full_disk_worker.py",
    )
    codes = g.wait(90)
    out = g.output()
    assert codes == [3, 3], out
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    # Failures at steps 2 and 4 (the second reaches max_failed_saves=2); both ranks learn
    # it in the collective of the save at step 6.
    assert sorted((r["rank"], r["raised_at"]) for r in lines) == [(0, 6), (1, 6)], out
    assert all("2 checkpoint saves in a row failed" in r["error"] for r in lines), out
    assert not list((tmp_path / "ck").glob("step_*"))
