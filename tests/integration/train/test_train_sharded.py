"""Sharded (DCP) checkpoints: saved at world size 2 with DTensor shards, loaded at 1 and 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from train_support import HERE, Launcher

WORKER = HERE / "dcp_worker.py"


def _results(group) -> list[dict]:
    out = []
    for log in group.logs:
        lines = [x for x in log.read_text().splitlines() if x.startswith("RESULT ")]
        assert lines, log.read_text()[-3000:]
        out.append(json.loads(lines[-1][len("RESULT ") :]))
    return out


@pytest.mark.timeout(300)
def test_dtensor_state_saved_at_world_2_loads_at_world_1_and_2(
    launcher: Launcher, tmp_path: Path
) -> None:
    root = tmp_path / "ck"
    save = launcher.start(2, ["save", str(root)], script=WORKER)
    assert save.wait(120) == [0, 0], save.output()
    manifest = json.loads((root / "step_5" / "manifest.json").read_text())
    assert manifest["meta"]["kind"] == "dcp" and manifest["world_size"] == 2
    assert ".metadata" in manifest["files"] and "rng_1.pt" in manifest["files"]
    for world in (1, 2):
        grp = launcher.start(world, ["load", str(root)], script=WORKER)
        assert grp.wait(120) == [0] * world, grp.output()
        for r in _results(grp):
            assert r == {
                "step": 5,
                "extra": {"epoch": 2},
                "saved_world": 2,
                "tensor_ok": True,
                "model_ok": True,
            }
