"""Nothing outside the run directory is touched (issue 18, point 3), with real runs.

A pipeline whose train stage keeps checkpoints in ``checkpointDir`` runs twice through
``python -m flexrun pipeline run``; the second time its input changed, so the runner
removes the stale checkpoints. A decoy directory with the same name beside the run
directory and an unrelated directory are snapshotted (names, sizes, mtimes, contents)
before and after: unchanged. Then a symlink out of the tree is planted where the
checkpoints were: the run is refused before any stage starts, exit 2, one line.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.timeout(300)

WRITER = """\
import argparse, os, pathlib
p = argparse.ArgumentParser()
p.add_argument("--data"); p.add_argument("--ckpt"); p.add_argument("--out")
a = p.parse_args()
ckpt = pathlib.Path(a.ckpt)
ckpt.mkdir(parents=True, exist_ok=True)
seen = sorted(x.name for x in ckpt.iterdir())
(ckpt / "step_1").write_text(pathlib.Path(a.data).read_text())
pathlib.Path(a.out).write_text("trained on " + pathlib.Path(a.data).read_text() + " found " + ",".join(seen))
"""


def _snapshot(*roots: Path) -> dict[str, tuple[int, int, str]]:
    out = {}
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            for name in [*dirnames, *filenames]:
                p = Path(dirpath) / name
                st = p.lstat()
                digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else ""
                out[str(p)] = (st.st_size if p.is_file() else 0, st.st_mtime_ns, digest)
    return out


def _flexrun(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
    return subprocess.run(
        [sys.executable, "-m", "flexrun", *args],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=cwd,
    )


def test_stale_checkpoints_are_removed_inside_the_run_dir_and_nothing_outside(
    tmp_path: Path,
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "writer.py").write_text(WRITER)
    (work / "seed.txt").write_text("one")
    decoy = work / "ckpt"  # same name as the checkpoint dir, one level up
    (decoy / "step_9").mkdir(parents=True)
    (decoy / "step_9" / "weights").write_bytes(b"decoy")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_text("keep")
    spec = work / "pipeline.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "name": "paths",
                "stages": [
                    {
                        "name": "prep",
                        "command": ["cp", "{pipeline_dir}/seed.txt", "data.txt"],
                        "inputs": ["{pipeline_dir}/seed.txt"],
                        "outputs": ["data.txt"],
                    },
                    {
                        "name": "train",
                        "inputs": ["data.txt"],
                        "outputs": ["model.txt"],
                        "train": {
                            "script": "{pipeline_dir}/writer.py",
                            "args": ["--data", "data.txt", "--ckpt", "ckpt", "--out", "model.txt"],
                            "checkpointDir": "ckpt",
                            "maxRestarts": 0,
                        },
                    },
                ],
            }
        )
    )
    before = _snapshot(decoy, outside)
    run = work / "run"
    first = _flexrun("pipeline", "run", str(spec), "--run-dir", "run", cwd=work)
    assert first.returncode == 0, first.stdout + first.stderr
    assert (run / "model.txt").read_text() == "trained on one found "
    (work / "seed.txt").write_text("two")  # the train stage's input changes ...
    second = _flexrun("pipeline", "run", str(spec), "--run-dir", "run", cwd=work)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "removing stale checkpoints" in second.stdout
    # ... so its old checkpoints were removed (it found none) and new ones written.
    assert (run / "model.txt").read_text() == "trained on two found "
    assert (run / "ckpt" / "step_1").read_text() == "two"
    assert _snapshot(decoy, outside) == before

    # A symlink out of the tree where the checkpoints live: refused before anything runs.
    (run / "ckpt" / "step_1").unlink()
    (run / "ckpt").rmdir()
    (run / "ckpt").symlink_to(outside)
    (work / "seed.txt").write_text("three")
    third = _flexrun("pipeline", "run", str(spec), "--run-dir", "run", cwd=work)
    assert third.returncode == 2, third.stdout + third.stderr
    lines = third.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in third.stderr
    assert "stages.train.train.checkpointDir: 'ckpt' resolves to" in lines[0]
    assert "not inside the run directory" in lines[0]
    assert (run / "data.txt").read_text() == "two"  # not even the first stage ran
    assert _snapshot(decoy, outside) == before
