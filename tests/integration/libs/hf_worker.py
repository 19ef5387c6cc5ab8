"""An HF Trainer script under flexrun (tests): tiny model, ElasticTrainer + FlexrunCallback.

Logs each trained micro-batch's sample ids as ``<step> <id> <id>...`` to ``<log>.<pid>``;
``--stop-at S`` saves and stops after global step S (a restart point of the test), otherwise
it trains ``--epochs`` epochs. ``--step-sleep`` slows steps (so a signal lands mid-run)."""

from __future__ import annotations

import argparse
import os
import time

import datasets
import torch
from torch import nn
from transformers import TrainerCallback, TrainingArguments

from flexrun.integrations.hf import ElasticTrainer, FlexrunCallback, latest_checkpoint

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--sample-log", required=True)
p.add_argument("--samples", type=int, default=60)
p.add_argument("--global-batch", type=int, default=8)
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--stop-at", type=int, default=0)
p.add_argument("--save-steps", type=int, default=1000)
p.add_argument("--step-sleep", type=float, default=0.0)
a = p.parse_args()
torch.set_num_threads(1)


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.step = 0

    def forward(self, x: torch.Tensor, idx: torch.Tensor, labels: torch.Tensor) -> dict:
        if self.training:
            with open(f"{a.sample_log}.{os.getpid()}", "a") as f:
                f.write(f"{self.step} " + " ".join(map(str, idx.tolist())) + "\n")
            time.sleep(a.step_sleep)
        return {"loss": nn.functional.mse_loss(self.lin(x).squeeze(-1), labels)}


class Marks(TrainerCallback):
    def on_step_begin(self, args, state, control, model=None, **kw):  # type: ignore[no-untyped-def]
        model.step = state.global_step

    def on_step_end(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
        if a.stop_at and state.global_step >= a.stop_at:
            control.should_save = control.should_training_stop = True
        return control


g = torch.Generator().manual_seed(0)
ds = datasets.Dataset.from_dict(
    {
        "x": torch.randn(a.samples, 4, generator=g).tolist(),
        "idx": list(range(a.samples)),
        "labels": torch.randn(a.samples, generator=g).tolist(),
    }
).with_format("torch")
args = TrainingArguments(
    output_dir=a.out,
    num_train_epochs=a.epochs,
    save_strategy="steps",
    save_steps=a.save_steps,
    logging_strategy="no",
    report_to=[],
    use_cpu=True,
    seed=3,
    learning_rate=1e-2,
    disable_tqdm=True,
    ddp_backend="gloo",
)
cb = FlexrunCallback()
trainer = ElasticTrainer(
    model=Tiny(), args=args, train_dataset=ds, global_batch_size=a.global_batch,
    callbacks=[cb, Marks()],
)  # fmt: skip
resume = latest_checkpoint(a.out)
print(f"resume_from={resume}", flush=True)
trainer.train(resume_from_checkpoint=resume)
print(f"done at step {trainer.state.global_step}", flush=True)
