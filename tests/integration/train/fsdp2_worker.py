"""FSDP2 worker for test_train_sharded_fsdp2.py: a ``fully_shard`` model and a raw Adam
registered as they are with ShardedCheckpointer, trained from the newest checkpoint (if
any) up to a step, saving at the steps named; rank 0 writes the full model and optimizer
state at the end so runs can be compared bitwise.

Usage: fsdp2_worker.py ROOT STOP SAVE_STEPS(comma list, may be empty) OUT_FILE [async]
(``async``: the saves are asynchronous and training goes on while they are written).
"""

from __future__ import annotations

import sys

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import flexrun.train as ft
from flexrun.train.sharded import ShardedCheckpointer


def _full(v: object) -> object:
    return v.full_tensor() if hasattr(v, "full_tensor") else v


def main() -> None:
    root, stop, save_arg, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    saves = {int(s) for s in save_arg.split(",") if s}
    asynchronous = sys.argv[5:] == ["async"]
    ctx = ft.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ck = ShardedCheckpointer(root)
    ck.register("model", model)
    ck.register("optim", opt)
    loaded = ck.load()
    start = loaded.step if loaded else 0
    state_after_load = len(opt.state)
    per_rank = 8 // ctx.world_size
    for step in range(start, stop):
        g = torch.Generator().manual_seed(1000 + step)
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
        lo = ctx.rank * per_rank
        loss = torch.nn.functional.mse_loss(model(x[lo : lo + per_rank]), y[lo : lo + per_rank])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step + 1 in saves:
            ck.save(step + 1, asynchronous=asynchronous)
    ck.wait()
    full = StateDictOptions(full_state_dict=True)
    params = {k: _full(v).detach().clone() for k, v in model.state_dict().items()}
    optim = get_optimizer_state_dict(model, opt, options=full)
    if ctx.rank == 0:
        torch.save(
            {
                "start": start,
                "state_after_load": state_after_load,
                "params": params,
                "optim_state": optim["state"],
            },
            out,
        )
    print(f"DONE start={start} state_after_load={state_after_load}", flush=True)
    ft.shutdown()


if __name__ == "__main__":
    main()
