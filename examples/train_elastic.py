"""Elastic, resumable DDP training on scikit-learn's digits: the recommended flexrun.train script.

Run it with any of:

    python examples/train_elastic.py
    torchrun --standalone --nproc-per-node 2 examples/train_elastic.py --ckpt-dir /tmp/ck
    flexrun run --nproc-per-node 2 examples/train_elastic.py --ckpt-dir /tmp/ck

Kill it at any moment (kill -9, a lost node, a different world size next time) and run it
again with the same ``--ckpt-dir``: it resumes from the newest checkpoint that verifies,
consumes every sample of every epoch exactly once, and keeps the global batch constant.
SIGTERM (a preemption) makes every rank stop at the next step boundary, save a final
checkpoint and exit 143.

Every rank logs its loss per sample; every ``--metrics-every`` steps the ranks' values are
averaged (weighted by samples, one small all-reduce) and rank 0 writes a ``train_metrics``
event (step, steps/s, samples/s, loss) to the run directory's ``events.jsonl``, which
``flexrun run --metrics-port`` and ``flexrun report`` read, and to TensorBoard in
``<run dir>/tensorboard`` when ``tensorboard`` is installed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

import flexrun.train as ft


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300, help="optimizer steps in total")
    p.add_argument("--ckpt-dir", default="./checkpoints", help="directory or fsspec URL")
    p.add_argument("--ckpt-every", type=int, default=25, help="save every N steps")
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument("--global-batch", type=int, default=64, help="samples per step, all ranks")
    p.add_argument("--micro-batch", type=int, default=16, help="samples per forward pass")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    p.add_argument("--sync-ckpt", action="store_true", help="persist in the foreground")
    p.add_argument("--run-dir", default=None, help="events.jsonl goes here (else FLEXRUN_RUN_DIR)")
    p.add_argument("--metrics-every", type=int, default=10, help="reduce/write metrics every N")
    p.add_argument("--sample-log", default=None, help="append consumed sample ids here (JSONL)")
    p.add_argument("--final-state", default=None, help="rank 0 writes final model+optim here")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step (tests)")
    p.add_argument("--crash-at-step", type=int, default=None, help="SIGKILL self after step N")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from sklearn.datasets import load_digits

    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    ctx = ft.init(run_dir=args.run_dir)
    torch.manual_seed(args.seed)  # same initial weights on every rank

    digits = load_digits()
    xs = torch.tensor(digits.data / 16.0, dtype=dtype)
    ys = torch.tensor(digits.target, dtype=torch.long)
    n = len(ys)

    model = torch.nn.Sequential(
        torch.nn.Linear(64, args.hidden),
        torch.nn.ReLU(),
        torch.nn.Dropout(args.dropout),
        torch.nn.Linear(args.hidden, 10),
    ).to(dtype=dtype, device=ctx.device)
    ddp = DDP(model) if ctx.world_size > 1 else None
    net = ddp if ddp is not None else model
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    sampler = ft.ElasticSampler(
        n,
        global_batch_size=args.global_batch,
        rank=ctx.rank,
        world_size=ctx.world_size,
        seed=args.seed,
    )
    plan = ft.BatchPlan(
        global_batch_size=args.global_batch,
        micro_batch_size=args.micro_batch,
        world_size=ctx.world_size,
    )
    ckpt = ft.Checkpointer(args.ckpt_dir, keep_last=args.keep_last, async_save=not args.sync_ckpt)
    ckpt.register("model", model)
    ckpt.register("optim", opt)
    ckpt.register("sampler", sampler)
    loaded = ckpt.load()
    step = loaded.step if loaded else 0
    guard = ft.PreemptionGuard(signals=(signal.SIGTERM, signal.SIGUSR1))
    metrics = ft.MetricsLogger(every_steps=args.metrics_every, weight_by_samples=True)

    log = open(f"{args.sample_log}.rank{ctx.rank}", "a") if args.sample_log else None  # noqa: SIM115
    if log is not None:
        log.write(json.dumps({"resume": step, "world_size": ctx.world_size}) + "\n")
        log.flush()
    if ctx.is_main:
        print(f"rank0: world={ctx.world_size} round={ctx.round} start_step={step}", flush=True)

    while step < args.steps:
        if sampler.exhausted:
            sampler.set_epoch(sampler.epoch + 1)
        loader = DataLoader(
            range(n),
            batch_sampler=sampler,
            collate_fn=torch.tensor,
            num_workers=args.workers,
            generator=torch.Generator(),  # keep the global RNG stream untouched
        )
        for idx in loader:
            step_samples = sampler.step_samples()
            slices = plan.micro_slices(len(idx), step_samples)
            step_loss = 0.0
            for i, sl in enumerate(slices):
                last = i == len(slices) - 1
                sync = contextlib.nullcontext() if last or ddp is None else ddp.no_sync()
                with sync:
                    part = idx[sl]
                    out = net(xs[part].to(ctx.device))
                    loss = F.cross_entropy(out, ys[part].to(ctx.device), reduction="sum")
                    (loss * plan.loss_scale(step_samples)).backward()
                    step_loss += float(loss.detach())
            opt.step()
            opt.zero_grad(set_to_none=True)
            if log is not None:
                rec = {"step": step + 1, "epoch": sampler.epoch, "ids": idx.tolist()}
                log.write(json.dumps(rec) + "\n")
                log.flush()
            sampler.advance(step_samples)
            step += 1
            rec = metrics.log(step, loss=step_loss / max(len(idx), 1), samples=len(idx))
            if step % args.ckpt_every == 0 or step == args.steps:
                ckpt.save(step, extra={"epoch": sampler.epoch}, blocking=step == args.steps)
            if ctx.is_main and rec is not None and step % 50 == 0:
                print(
                    f"step {step} epoch {sampler.epoch} loss/sample {rec['loss']:.4f} "
                    f"steps/s {rec['steps_per_s']:.1f}",
                    flush=True,
                )
            if args.crash_at_step is not None and step == args.crash_at_step:
                os.kill(os.getpid(), signal.SIGKILL)
            if guard.should_stop():
                if step % args.ckpt_every != 0:
                    ckpt.save(step, extra={"epoch": sampler.epoch}, blocking=True)
                ckpt.close()
                metrics.close()
                if ctx.is_main:
                    print(f"rank0: preempted at step {step}; checkpoint saved", flush=True)
                ft.shutdown()
                guard.exit(step=step)
            if args.step_sleep:
                time.sleep(args.step_sleep)
            if step >= args.steps or sampler.exhausted:
                break
    ckpt.close()
    metrics.close()
    if ctx.is_main and args.final_state:
        torch.save(
            {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}, args.final_state
        )
    if ctx.is_main:
        print(f"rank0: done at step {step}", flush=True)
    if log is not None:
        log.close()
    ft.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
