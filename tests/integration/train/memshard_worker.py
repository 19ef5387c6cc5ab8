"""An FSDP2 (``fully_shard``) training script saving every step with the memory tier
(``ShardedCheckpointer(durable_every=K)``), for test_train_memshard_run.py.

Usage: memshard_worker.py --ckpt-dir D --steps N --durable-every K --step-log L [--final F]
[--corrupt-at S --corrupt-rank R] [--step-sleep T]. Each rank appends JSON lines to ``L``:
one ``resume`` record per start, then one per step it completed, written before the step's
save (so a kill between the two costs at most that step). Inputs are a function of (step,
rank), so a resumed run is bitwise the uninterrupted one. ``--corrupt-at S``: in the first
launch rank R flips a byte of its memory copy of step S once written, then kills itself
(kill -9). Every rank gathers the full model and optimizer state at the end; rank 0 writes
it to ``F``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import flexrun.train as ft
from flexrun.train.sharded import ShardedCheckpointer


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--durable-every", type=int, required=True)
    p.add_argument("--step-log", required=True)
    p.add_argument("--final", default=None)
    p.add_argument("--corrupt-at", type=int, default=0)
    p.add_argument("--corrupt-rank", type=int, default=0)
    p.add_argument("--step-sleep", type=float, default=0.0)
    args = p.parse_args()
    torch.set_num_threads(1)
    ctx = ft.init(timeout_s=60)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ckpt = ShardedCheckpointer(args.ckpt_dir, durable_every=args.durable_every)
    ckpt.register("model", model)
    ckpt.register("optim", opt)
    loaded = ckpt.load()
    start = loaded.step if loaded is not None else 0
    log = open(f"{args.step_log}.rank{ctx.rank}", "a", buffering=1)  # noqa: SIM115
    log.write(json.dumps({"resume": start, "pid": os.getpid(), "world": ctx.world_size}) + "\n")
    for step in range(start + 1, args.steps + 1):
        g = torch.Generator().manual_seed(step * 1000 + ctx.rank)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        log.write(json.dumps({"step": step, "pid": os.getpid()}) + "\n")
        ckpt.save(step, extra={"step": step})
        corrupt = step == args.corrupt_at and ctx.rank == args.corrupt_rank
        if corrupt and ctx.restart_count == 0:
            pattern = f"ckpt-*/rank_{ctx.rank}/step_{step}.mem"
            copy = next(Path(ctx.memory_dir or "").glob(pattern))
            blob = bytearray(copy.read_bytes())
            blob[len(blob) // 2] ^= 0x01
            copy.write_bytes(bytes(blob))
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(args.step_sleep)
    ckpt.wait()
    full = StateDictOptions(full_state_dict=True)
    final = {
        "model": get_model_state_dict(model, options=full),
        "optim": get_optimizer_state_dict(model, opt, options=full),
    }
    if ctx.rank == 0 and args.final:
        torch.save(final, args.final)
    ft.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
