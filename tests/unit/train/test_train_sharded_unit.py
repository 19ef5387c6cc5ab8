from __future__ import annotations

import hashlib
import json
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from flexrun.errors import CheckpointError
from flexrun.train.context import single_process_context
from flexrun.train.sharded import ShardedCheckpointer


class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (self.marker,))


def _ck(root: Path) -> tuple[ShardedCheckpointer, torch.nn.Module]:
    m = torch.nn.Linear(3, 2)
    c = ShardedCheckpointer(root, ctx=single_process_context())
    c.register("model", m)
    return c, m


def test_single_process_roundtrip(tmp_path: Path) -> None:
    c, m = _ck(tmp_path)
    c.save(3, extra={"k": 1})
    want = m.weight.detach().clone()
    with torch.no_grad():
        m.weight.zero_()
    loaded = c.load()
    assert loaded is not None and loaded.step == 3 and loaded.extra == {"k": 1}
    assert torch.equal(m.weight, want)


def test_metadata_that_runs_code_is_refused(tmp_path: Path) -> None:
    c, _ = _ck(tmp_path)
    c.save(1)
    step = tmp_path / "step_1"
    marker = tmp_path / "pwned"
    evil = pickle.dumps(_Evil(str(marker)))
    (step / ".metadata").write_bytes(evil)
    man = json.loads((step / "manifest.json").read_text())
    man["files"][".metadata"] = {"size": len(evil), "sha256": hashlib.sha256(evil).hexdigest()}
    (step / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(CheckpointError, match="refused global"):
        c.load()
    assert not marker.exists()
