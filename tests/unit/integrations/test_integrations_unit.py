"""The library integrations' own rules, in one process: the epoch-length sampler, the newest
complete HF checkpoint, the sampler-order check of a resumed HF run, and what the Lightning
callback refuses."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from flexrun.errors import CheckpointError, ConfigError
from flexrun.integrations._common import EpochSampler
from flexrun.train.sampler import ElasticSampler

pytestmark = pytest.mark.timeout(120)


def _needs(module: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(
        importlib.util.find_spec(module) is None,
        reason=f"{module} not installed (pip install 'flexrun[integrations]')",
    )


def test_epoch_sampler_length_is_a_whole_epoch_also_mid_epoch() -> None:
    s = EpochSampler(60, global_batch_size=8, rank=0, world_size=2, seed=1)
    plain = ElasticSampler(60, global_batch_size=8, rank=0, world_size=2, seed=1)
    for _ in range(3):
        s.advance()
        plain.advance()
    assert len(s) == 8 and len(plain) == 5
    assert list(s) == list(plain)  # the same remaining steps, only the length differs
    s.place(1, 3)
    assert (s.rank, s.world_size) == (1, 3)
    with pytest.raises(ValueError):
        s.place(3, 3)


@_needs("transformers")
def test_latest_checkpoint_is_the_newest_every_rank_finished(tmp_path: Path) -> None:
    from flexrun.integrations.hf import MARKER, latest_checkpoint

    assert latest_checkpoint(tmp_path / "missing") is None
    for step, complete in ((5, True), (10, True), (15, False)):
        d = tmp_path / f"checkpoint-{step}"
        d.mkdir()
        if complete:
            (d / MARKER).write_text("{}")
    (tmp_path / "checkpoint-x").mkdir()
    assert latest_checkpoint(tmp_path) == str(tmp_path / "checkpoint-10")


@_needs("transformers")
def test_a_resumed_hf_run_with_another_data_order_is_refused(tmp_path: Path) -> None:
    from flexrun.integrations.hf import MARKER, FlexrunCallback

    cb = FlexrunCallback()
    try:
        cb.sampler = EpochSampler(60, global_batch_size=8, seed=3)
        d = tmp_path / "checkpoint-5"
        d.mkdir()
        saved = EpochSampler(60, global_batch_size=16, seed=3).state_dict()
        (d / MARKER).write_text(json.dumps({"sampler": saved}))
        args = SimpleNamespace(output_dir=str(tmp_path), gradient_accumulation_steps=1)
        with pytest.raises(CheckpointError, match="global_batch_size"):
            cb.on_train_begin(args, SimpleNamespace(global_step=5), None)
        saved["global_batch_size"] = 8
        (d / MARKER).write_text(json.dumps({"sampler": saved}))
        cb.on_train_begin(args, SimpleNamespace(global_step=5), None)
        # The epoch the Trainer runs is global_step // steps_per_epoch (8 steps an epoch).
        cb.on_epoch_begin(args, SimpleNamespace(global_step=13), None)
        assert cb.sampler.epoch == 1 and cb.sampler.consumed == 0
    finally:
        cb.guard.uninstall()


@_needs("lightning")
def test_lightning_callback_takes_only_an_epoch_sampler() -> None:
    from flexrun.integrations.lightning import FlexrunCallback

    with pytest.raises(ConfigError, match="EpochSampler"):
        FlexrunCallback(ElasticSampler(10, global_batch_size=2))
    cb = FlexrunCallback(EpochSampler(10, global_batch_size=2, seed=0))
    cb.sampler.advance()  # type: ignore[union-attr]
    state = cb.state_dict()
    other = FlexrunCallback(EpochSampler(10, global_batch_size=2, seed=0))
    other.load_state_dict(state)
    assert other.sampler is not None and other.sampler.consumed == 2


@_needs("transformers")
def test_elastic_trainer_refuses_ignore_data_skip(tmp_path: Path) -> None:
    import torch
    from transformers import TrainingArguments

    from flexrun.integrations.hf import ElasticTrainer

    args = TrainingArguments(
        output_dir=str(tmp_path), ignore_data_skip=True, use_cpu=True, report_to=[]
    )
    with pytest.raises(ConfigError, match="ignore_data_skip"):
        ElasticTrainer(model=torch.nn.Linear(2, 1), args=args, global_batch_size=4)
