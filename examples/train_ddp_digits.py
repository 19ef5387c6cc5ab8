"""A plain torchrun-style DDP script: no flexrun imports, checkpoint/resume written by hand.

Trains a small MLP on scikit-learn's bundled handwritten digits (1,797 8x8 images, no
download) and resumes from its checkpoint after a restart, the way most torchrun users
write it. Runs unchanged under `torchrun` and `flexrun run`:

    flexrun run --standalone --nproc-per-node 2 examples/train_ddp_digits.py
    torchrun   --standalone --nproc-per-node 2 examples/train_ddp_digits.py

For the resume logic done once, right (atomic async checkpoints, exactly-once data across
resizes, constant global batch), see examples/train_elastic.py, which uses flexrun.train.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--ckpt", default="digits_ddp.pt", help="checkpoint file (rank 0 writes it)")
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    n_val = 297
    train = TensorDataset(x[n_val:], y[n_val:])
    x_val, y_val = x[:n_val], y[:n_val]

    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    start_epoch = 0
    if os.path.exists(args.ckpt):
        state = torch.load(args.ckpt, weights_only=True)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start_epoch = int(state["epoch"])
        if rank == 0:
            print(f"resumed from {args.ckpt} at epoch {start_epoch}", flush=True)

    sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for xb, yb in loader:
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
        with torch.no_grad():
            acc = (model.module(x_val).argmax(1) == y_val).float().mean().item()
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs} loss {loss.item():.4f} val_acc {acc:.3f}", flush=True)
            tmp = args.ckpt + ".tmp"
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch + 1}, tmp)
            os.replace(tmp, args.ckpt)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
