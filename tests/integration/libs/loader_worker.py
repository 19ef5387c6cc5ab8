"""torchdata ``StatefulDataLoader`` over an HF map-style ``datasets.Dataset`` with flexrun's
``ElasticSampler`` as its ``batch_sampler`` (tests): the sampler is the checkpoint's data
position (``flexrun.train.Checkpointer``); a DDP model trains on the samples.

Logs each step's sample ids as ``<step> <id> <id>...`` to ``<log>.<pid>`` (``step`` counted
from the start of the run: epoch = step // steps per epoch); ``--stop-at S`` saves and stops
after global step S, otherwise it trains ``--epochs`` epochs."""

from __future__ import annotations

import argparse
import os

import datasets
import torch
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader

import flexrun.train as ft

p = argparse.ArgumentParser()
p.add_argument("--ckpt", required=True)
p.add_argument("--sample-log", required=True)
p.add_argument("--samples", type=int, default=60)
p.add_argument("--global-batch", type=int, default=8)
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--stop-at", type=int, default=0)
p.add_argument("--loader-workers", type=int, default=1)
a = p.parse_args()
torch.set_num_threads(1)

ctx = ft.init()
ds = datasets.Dataset.from_dict(
    {"id": list(range(a.samples)), "x": torch.randn(a.samples, 4).tolist()}
).with_format("torch")
sampler = ft.ElasticSampler(
    a.samples, global_batch_size=a.global_batch, rank=ctx.rank, world_size=ctx.world_size, seed=5
)
model = nn.Linear(4, 1)
ddp = torch.nn.parallel.DistributedDataParallel(model) if ctx.world_size > 1 else model
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
ckpt = ft.Checkpointer(a.ckpt, async_save=False)
ckpt.register("model", model)
ckpt.register("optim", opt)
ckpt.register("sampler", sampler)
loaded = ckpt.load()
step = loaded.step if loaded else 0
per_epoch = -(-a.samples // a.global_batch)
done = False
while not done:
    if sampler.exhausted:
        if sampler.epoch + 1 >= a.epochs:
            break
        sampler.set_epoch(sampler.epoch + 1)
    loader = StatefulDataLoader(ds, batch_sampler=sampler, num_workers=a.loader_workers)
    for batch in loader:
        loss = ddp(batch["x"]).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        with open(f"{a.sample_log}.{os.getpid()}", "a") as f:
            f.write(f"{step} " + " ".join(map(str, batch["id"].tolist())) + "\n")
        sampler.advance()
        step += 1
        if a.stop_at and step >= a.stop_at:
            ckpt.save(step, blocking=True)
            done = True
            break
ckpt.close()
if ctx.is_main:
    print(f"done at step {step} of {per_epoch * a.epochs}", flush=True)
ft.shutdown()
