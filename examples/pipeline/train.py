"""Pipeline stage 2: elastic DDP training on the preprocessed digits, resumable.

Run by the pipeline as ``flexrun run --standalone --nproc-per-node N train.py ...``.
Checkpoints go to ``--ckpt-dir`` through ``flexrun.train.Checkpointer`` (atomic, verified);
after a kill the stage starts again and resumes from the newest checkpoint (the log line
``start_step=N`` says where). Rank 0 writes the final weights to ``<out>/weights.pt`` and
``<out>/config.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import build_model, load_split
from torch.nn.parallel import DistributedDataParallel as DDP

import flexrun.train as ft


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default="data")
    p.add_argument("--out", default="model")
    p.add_argument("--ckpt-dir", default="ckpt")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step (tests)")
    args = p.parse_args(argv)

    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    ctx = ft.init()
    torch.manual_seed(args.seed)  # same initial weights on every rank
    xs, ys = load_split(args.data, "train")
    model = build_model(args.hidden)
    net = DDP(model) if ctx.world_size > 1 else model
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sampler = ft.ElasticSampler(
        len(ys),
        global_batch_size=args.global_batch,
        rank=ctx.rank,
        world_size=ctx.world_size,
        seed=args.seed,
    )
    ckpt = ft.Checkpointer(args.ckpt_dir, keep_last=2)
    ckpt.register("model", model)
    ckpt.register("optim", opt)
    ckpt.register("sampler", sampler)
    loaded = ckpt.load()
    step = loaded.step if loaded else 0
    guard = ft.PreemptionGuard(signals=(signal.SIGTERM,))
    if ctx.is_main:
        print(f"train: world={ctx.world_size} round={ctx.round} start_step={step}", flush=True)

    while step < args.steps:
        if sampler.exhausted:
            sampler.set_epoch(sampler.epoch + 1)
        for idx in sampler:
            step_samples = sampler.step_samples()
            part = torch.as_tensor(idx, dtype=torch.long)
            loss = F.cross_entropy(net(xs[part]), ys[part], reduction="sum") / step_samples
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sampler.advance(step_samples)
            step += 1
            if step % args.ckpt_every == 0 or step == args.steps:
                ckpt.save(step, blocking=step == args.steps)
            if ctx.is_main and step % 10 == 0:
                print(
                    f"train: step {step} loss {float(loss.detach()) * ctx.world_size:.4f}",
                    flush=True,
                )
            if guard.should_stop():
                ckpt.save(step, blocking=True)
                ckpt.close()
                guard.exit(step=step)
            if args.step_sleep:
                time.sleep(args.step_sleep)
            if step >= args.steps:
                break
    ckpt.close()
    if ctx.is_main:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / ".weights.pt.tmp"
        torch.save(model.state_dict(), tmp)
        os.replace(tmp, out / "weights.pt")
        config = {"hidden": args.hidden, "steps": step, "world_size": ctx.world_size}
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        print(f"train: done at step {step}; weights in {out}", flush=True)
    if dist.is_initialized():
        # Wait here, in a collective, rather than in destroy_process_group's store polling.
        dist.barrier()
    ft.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
