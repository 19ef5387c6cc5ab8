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


class _LazyState:
    """A Stateful whose state dict is empty until it has state (what a raw optimizer's is
    in a fresh process): DCP alone would load nothing into it, silently."""

    def __init__(self) -> None:
        self.state: dict[str, torch.Tensor] = {}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.state)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.state = dict(state)


def test_state_an_object_would_drop_on_load_is_refused(tmp_path: Path) -> None:
    c = ShardedCheckpointer(tmp_path, ctx=single_process_context())
    lazy = _LazyState()
    lazy.state["m"] = torch.ones(3)
    c.register("lazy", lazy)
    c.save(1)
    fresh = ShardedCheckpointer(tmp_path, ctx=single_process_context())
    fresh.register("lazy", _LazyState())
    with pytest.raises(CheckpointError, match=r"would be dropped: lazy\.m"):
        fresh.load()


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    for i in range(3):
        g = torch.Generator().manual_seed(i)
        loss = model(torch.randn(4, 3, generator=g)).square().sum()
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_raw_optimizer_over_two_modules_restores_its_state_in_a_fresh_process(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    enc, dec = torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)
    opt = torch.optim.Adam([*enc.parameters(), *dec.parameters()], lr=0.1)
    _train(torch.nn.Sequential(enc, dec), opt)
    c = ShardedCheckpointer(tmp_path, ctx=single_process_context())
    c.register("optim", opt)  # before the modules it trains: resolved at save time
    c.register("enc", enc)
    c.register("dec", dec)
    c.save(3)
    torch.manual_seed(1)
    enc2, dec2 = torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)
    opt2 = torch.optim.Adam([*enc2.parameters(), *dec2.parameters()], lr=0.1)
    c2 = ShardedCheckpointer(tmp_path, ctx=single_process_context())
    c2.register("enc", enc2)
    c2.register("dec", dec2)
    c2.register("optim", opt2)
    assert len(opt2.state) == 0
    loaded = c2.load()
    assert loaded is not None and loaded.step == 3
    assert torch.equal(enc2.weight, enc.weight) and torch.equal(dec2.bias, dec.bias)
    assert len(opt2.state) == len(opt.state) == 4
    for p, p2 in zip(
        [*enc.parameters(), *dec.parameters()],
        [*enc2.parameters(), *dec2.parameters()],
        strict=True,
    ):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], opt2.state[p2][key]), key


def test_optimizer_of_an_unregistered_module_is_refused(tmp_path: Path) -> None:
    m = torch.nn.Linear(3, 2)
    c = ShardedCheckpointer(tmp_path, ctx=single_process_context())
    c.register("optim", torch.optim.Adam(m.parameters()))
    with pytest.raises(CheckpointError, match="steps parameters of no registered module"):
        c.save(1)
    assert c.steps() == []
    with pytest.raises(CheckpointError, match="steps parameters of no registered module"):
        c.load()


def test_an_asynchronous_save_holds_the_state_of_when_it_was_called(tmp_path: Path) -> None:
    c, m = _ck(tmp_path)
    want = m.weight.detach().clone()
    pending = c.save(4, asynchronous=True, extra={"k": 2})
    assert pending is not None and pending.stall_s >= 0
    with torch.no_grad():
        m.weight.add_(1.0)  # training goes on while the save is written
    pending.wait(timeout=60)
    assert pending.done() and c.steps() == [4]
    with torch.no_grad():
        m.weight.zero_()
    loaded = c.load()
    assert loaded is not None and loaded.step == 4 and loaded.extra == {"k": 2}
    assert torch.equal(m.weight, want)


def test_an_asynchronous_save_that_cannot_stage_commits_nothing_and_says_so(
    tmp_path: Path,
) -> None:
    c, _ = _ck(tmp_path)
    c.save(1)
    c.register("bad", _Unpicklable())  # its state cannot be copied (staged)
    with pytest.raises(CheckpointError, match="sharded save failed: rank 0: .*pickle"):
        c.save(2, asynchronous=True)
    c.wait()  # (nothing under way)
    assert c.steps() == [1]
    assert not list(tmp_path.glob(".tmp-step_2*"))


class _Unpicklable:
    def state_dict(self) -> dict[str, object]:
        return {"lock": __import__("threading").Lock()}

    def load_state_dict(self, state: dict[str, object]) -> None:
        pass
