"""An HF ``Trainer`` script made elastic by flexrun: kill -9 a worker, SIGTERM the job, restart
it at another world size; it resumes from its newest complete checkpoint and trains every
sample of every epoch once.

    flexrun run --nproc-per-node 2 --spare-preload transformers.trainer \\
        examples/libraries/hf_trainer.py --out /tmp/hf-out

``ElasticTrainer`` draws batches from flexrun's ``ElasticSampler`` at a constant global batch
size; its ``FlexrunCallback`` saves ``checkpoint-N`` when the job is preempted (SIGTERM) and
marks each checkpoint complete once every rank saved it (``latest_checkpoint``).
``--progress FILE`` appends one JSON line per optimizer step (``bench/bench_libraries.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from torch import nn
from transformers import TrainerCallback, TrainingArguments

from flexrun.integrations.hf import ElasticTrainer, latest_checkpoint

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--out", required=True, help="the Trainer's output_dir (checkpoints)")
p.add_argument("--samples", type=int, default=4096)
p.add_argument("--global-batch", type=int, default=8)
p.add_argument("--steps", type=int, default=-1, help="max_steps (default: --epochs)")
p.add_argument("--epochs", type=int, default=1)
p.add_argument("--save-steps", type=int, default=5)
p.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step")
p.add_argument("--progress", default="", help="append one JSON line per step here")
a = p.parse_args()
torch.set_num_threads(1)


class Regression(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 16, generator=g), torch.randn(n, generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        time.sleep(a.step_time)
        return {"loss": nn.functional.mse_loss(self.net(x).squeeze(-1), labels)}


class Progress(TrainerCallback):
    def on_step_end(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
        if a.progress:
            row = {"pid": os.getpid(), "rank": args.process_index, "step": state.global_step}
            with open(a.progress, "a") as f:
                f.write(json.dumps({**row, "ts": time.time()}) + "\n")


args = TrainingArguments(
    output_dir=a.out,
    max_steps=a.steps,
    num_train_epochs=a.epochs,
    save_strategy="steps",
    save_steps=a.save_steps,
    logging_strategy="no",
    report_to=[],
    use_cpu=True,
    ddp_backend="gloo",
    disable_tqdm=True,
)
trainer = ElasticTrainer(
    model=Model(),
    args=args,
    train_dataset=Regression(a.samples),
    global_batch_size=a.global_batch,
    callbacks=[Progress()],
)
trainer.train(resume_from_checkpoint=latest_checkpoint(a.out))
print(f"done at step {trainer.state.global_step}", flush=True)
