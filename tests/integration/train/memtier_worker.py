"""A small DDP training script that saves every step with the memory tier (``durable_every``).

Usage: memtier_worker.py --ckpt-dir D --steps N --durable-every K --step-log L [--final F]
[--corrupt-at S] [--step-sleep T]. Each rank appends JSON lines to ``L``: one ``resume``
record (the step it resumed from and where the state came from) per start, then one per
step completed. Inputs are a function of (step, rank) and dropout draws from the saved
RNG, so a resumed run is bitwise the uninterrupted one. ``--corrupt-at S``: in the first
launch rank 0 flips a byte of its memory copy of step S once written, then kills itself
(kill -9), so the restarted job finds that copy corrupt. Rank 0 writes the final model
and optimizer state to ``F``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import flexrun.train as ft


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--durable-every", type=int, required=True)
    p.add_argument("--step-log", required=True)
    p.add_argument("--final", default=None)
    p.add_argument("--corrupt-at", type=int, default=0)
    p.add_argument("--step-sleep", type=float, default=0.0)
    args = p.parse_args()
    torch.set_num_threads(1)
    ctx = ft.init(timeout_s=60)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 4))
    model = DDP(net) if ctx.world_size > 1 else net
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    ckpt = ft.Checkpointer(args.ckpt_dir, durable_every=args.durable_every)
    ckpt.register("model", net)
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
        ckpt.save(step, extra={"step": step}, blocking=step == args.steps)
        log.write(json.dumps({"step": step, "pid": os.getpid(), "t": time.time()}) + "\n")
        if step == args.corrupt_at and ctx.rank == 0 and ctx.restart_count == 0:
            ckpt.wait()  # the copy of this step is written
            copy = next(Path(ctx.memory_dir or "").glob(f"ckpt-*/step_{step}.mem"))
            blob = bytearray(copy.read_bytes())
            blob[len(blob) // 2] ^= 0x01
            copy.write_bytes(bytes(blob))
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(args.step_sleep)
    ckpt.close()
    if ctx.rank == 0 and args.final:
        torch.save({"model": net.state_dict(), "optim": opt.state_dict()}, args.final)
    ft.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
