"""Live recovery for a sharded model: HSDP (FSDP2 within replica groups), flexrun's live mode.

Run it with (2 replica groups x 2 shards on one node):

    flexrun run --standalone --nproc-per-node 4 --mode live --live-shards 2 \\
        examples/train_live_hsdp.py --steps 200

Kill any worker (kill -9 or SIGSTOP): its replica group leaves the step, the other group
commits it and keeps its processes, and a new group (warm spares) takes shard i of its
model and optimizer state from the healthy group's shard i, with no storage read, then
trains on at the same global batch.

What differs from a torchtitan-style HSDP script (``init_device_mesh(..., (R, S),
mesh_dim_names=("replicate", "shard"))`` then ``fully_shard(module, mesh=mesh)``):

1. the mesh is ``shard_mesh()``: the shard dimension only, this worker's replica group
   (flexrun forms its process group; do not call ``init_process_group``). The replicate
   dimension is the loop's: it sums the gradients across groups with collectives it can
   abandon when a group dies;
2. the step loop is a ``LiveLoop`` (it splits the global batch over every rank of every
   group and steps the optimizer); the body calls ``step.backward(loss)``;
3. (optional) what a step trained is logged from ``on_commit``, which the loop calls right
   after the optimizer step, as a torchrun script logs after ``opt.step()``: a body can
   run again after a failure, a commit happens once.

Each rank appends one JSON line per step body to ``--progress`` (a step redone after a
failure: twice), one per committed step to ``--commits``, and, at the end, writes its
shard of the model and optimizer state to ``--out DIR`` (for comparisons).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from torch.distributed.fsdp import fully_shard
from torch.utils.data import TensorDataset

from flexrun.train.live import LiveLoop, shard_mesh, state_checksum


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--dim", type=int, default=64, help="model width")
    p.add_argument("--blocks", type=int, default=2, help="MLP blocks (each fully_shard-ed)")
    p.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step")
    p.add_argument("--progress", default="", help="JSON lines, one per rank and step body")
    p.add_argument("--commits", default="", help="JSON lines, one per rank and committed step")
    p.add_argument("--out", default="", help="directory for each rank's final shard")
    p.add_argument("--ckpt-dir", default="", help="durable checkpoints (DCP), for losing all")
    p.add_argument("--ckpt-every", type=int, default=0, help="save every N steps (0: never)")
    return p.parse_args(argv)


def sharded(dim: int, blocks: int, mesh: object) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model, each block and the whole sharded on ``mesh``, and its optimizer."""
    model = build(dim, blocks)
    for block in list(model)[:-1]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def samples(dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data set: 1024 seeded inputs and their targets."""
    g = torch.Generator().manual_seed(42)
    x = torch.randn(1024, dim, generator=g)
    return x, x[:, :1].sin() + 0.1 * torch.randn(1024, 1, generator=g)


def build(dim: int, blocks: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [
        torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(),
                            torch.nn.Linear(4 * dim, dim))
        for _ in range(blocks)
    ]  # fmt: skip
    return torch.nn.Sequential(*layers, torch.nn.Linear(dim, 1))


def _log(path: str, row: dict) -> None:
    if path:
        with open(path, "a") as fh:
            fh.write(json.dumps(row) + "\n")


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    mesh = shard_mesh("cpu")  # (1) this worker's replica group
    model, opt = sharded(a.dim, a.blocks, mesh)
    data = TensorDataset(*samples(a.dim))

    rows: dict[int, dict] = {}  # (a step's body row, until its commit is logged)

    def committed(number: int) -> None:  # (3) right after the optimizer step
        _log(a.commits, {**rows.pop(number), "ts": time.time()})

    loop = LiveLoop(
        model,
        opt,
        data,
        global_batch=a.global_batch,
        steps=a.steps,
        seed=3,
        checkpoint_dir=a.ckpt_dir or None,
        checkpoint_every=a.ckpt_every,
        on_commit=committed,
    )  # (2)
    for step in loop:
        for xb, yb in step.batches():
            step.backward(torch.nn.functional.mse_loss(model(xb), yb))
        if a.step_time:
            time.sleep(a.step_time)
        row = {"ts": time.time(), "step": step.number, "rank": step.rank,
               "world": step.world_size, "pid": os.getpid(),
               "epoch": loop.epoch.number if loop.epoch else None}  # fmt: skip
        _log(a.progress, {**row, "ids": step.indices})
        rows.clear()  # (a body redone after a failure replaces the one before)
        rows[step.number] = row
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        shard = int(os.environ["FLEXRUN_LIVE_SHARD"])
        state = {
            "model": {k: v.to_local() for k, v in model.state_dict().items()},
            "optim": {
                i: {k: v.to_local() if hasattr(v, "to_local") else v for k, v in s.items()}
                for i, s in opt.state_dict()["state"].items()
            },
            "checksum": state_checksum(model),
        }
        torch.save(state, os.path.join(a.out, f"shard{shard}-{os.getpid()}.pt"))
    loop.close()


if __name__ == "__main__":
    main()
