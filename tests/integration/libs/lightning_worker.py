"""A Lightning script under flexrun (tests): tiny module, FlexrunCallback with an EpochSampler.

Logs each trained batch's sample ids as ``<step> <id> <id>...`` to ``<log>.<pid>``;
``--stop-at S`` stops after global step S (a ``ModelCheckpoint`` saves every step, so that is a
restart point of the test), otherwise it trains ``--epochs`` epochs. ``--step-sleep`` slows
steps (so a signal lands mid-run)."""

from __future__ import annotations

import argparse
import os
import time

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from flexrun.integrations.lightning import EpochSampler, FlexrunCallback

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--sample-log", required=True)
p.add_argument("--samples", type=int, default=60)
p.add_argument("--global-batch", type=int, default=8)
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--stop-at", type=int, default=0)
p.add_argument("--save-every", type=int, default=1)
p.add_argument("--step-sleep", type=float, default=0.0)
a = p.parse_args()
torch.set_num_threads(1)


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, idx, y = batch
        with open(f"{a.sample_log}.{os.getpid()}", "a") as f:
            f.write(f"{self.trainer.global_step} " + " ".join(map(str, idx.tolist())) + "\n")
        time.sleep(a.step_sleep)
        return nn.functional.mse_loss(self.lin(x).squeeze(-1), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-2)


class StopAt(pl.Callback):
    def on_train_batch_end(self, trainer, *args):  # type: ignore[no-untyped-def]
        if a.stop_at and trainer.global_step >= a.stop_at:
            trainer.should_stop = True


g = torch.Generator().manual_seed(0)
ds = TensorDataset(torch.randn(a.samples, 4, generator=g), torch.arange(a.samples),
                   torch.randn(a.samples, generator=g))  # fmt: skip
sampler = EpochSampler(a.samples, global_batch_size=a.global_batch, seed=3)
loader = DataLoader(ds, batch_sampler=sampler)
trainer = pl.Trainer(
    accelerator="cpu",
    devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
    strategy="ddp" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else "auto",
    max_epochs=a.epochs,
    use_distributed_sampler=False,
    callbacks=[
        FlexrunCallback(sampler),
        StopAt(),
        ModelCheckpoint(
            dirpath=a.out, every_n_train_steps=a.save_every, save_last=True, save_top_k=0
        ),  # fmt: skip
    ],
    logger=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
trainer.fit(Tiny(), loader, ckpt_path="last")
print(f"done at step {trainer.global_step}", flush=True)
