"""A Lightning script made elastic by flexrun: kill -9 a worker, SIGTERM the job, restart it
at another world size; it resumes from ``last.ckpt`` and trains every sample of every epoch
once.

    flexrun run --nproc-per-node 2 --spare-preload lightning.pytorch \\
        examples/libraries/lightning_fit.py --out /tmp/pl-out

The training ``DataLoader`` takes an ``EpochSampler`` (flexrun's ``ElasticSampler``) as its
``batch_sampler``; ``FlexrunCallback`` sets its rank and world size, keeps its position in the
checkpoint and saves ``last.ckpt`` when the job is preempted (SIGTERM).
``--progress FILE`` appends one JSON line per optimizer step (``bench/bench_libraries.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from flexrun.integrations.lightning import EpochSampler, FlexrunCallback

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--out", required=True, help="checkpoint directory")
p.add_argument("--samples", type=int, default=4096)
p.add_argument("--global-batch", type=int, default=8)
p.add_argument("--steps", type=int, default=-1, help="max_steps (default: --epochs)")
p.add_argument("--epochs", type=int, default=1)
p.add_argument("--save-steps", type=int, default=5)
p.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step")
p.add_argument("--progress", default="", help="append one JSON line per step here")
a = p.parse_args()
torch.set_num_threads(1)


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        time.sleep(a.step_time)
        return nn.functional.mse_loss(self.net(x).squeeze(-1), y)

    def on_train_batch_end(self, outputs: object, batch: object, batch_idx: int) -> None:
        if a.progress:
            row = {"pid": os.getpid(), "rank": self.global_rank, "step": self.global_step}
            with open(a.progress, "a") as f:
                f.write(json.dumps({**row, "ts": time.time()}) + "\n")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(a.samples, 16, generator=g), torch.randn(a.samples, generator=g))
sampler = EpochSampler(a.samples, global_batch_size=a.global_batch, seed=0)
trainer = pl.Trainer(
    accelerator="cpu",
    devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
    num_nodes=int(os.environ.get("WORLD_SIZE", "1"))
    // int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
    strategy="ddp" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else "auto",
    max_steps=a.steps,
    max_epochs=a.epochs,
    use_distributed_sampler=False,  # (the sampler splits each step among the ranks)
    callbacks=[
        FlexrunCallback(sampler),
        ModelCheckpoint(
            dirpath=a.out, every_n_train_steps=a.save_steps, save_last=True, save_top_k=0
        ),
    ],
    logger=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
trainer.fit(Model(), DataLoader(data, batch_sampler=sampler), ckpt_path="last")
print(f"done at step {trainer.global_step}", flush=True)
