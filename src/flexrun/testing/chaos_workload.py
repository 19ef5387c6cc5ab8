"""The chaos workload: a small float64 training script whose logs make every invariant checkable.

Owns nothing but evidence. Per committed-or-attempted step each rank appends one JSON line
to ``<log-dir>/steps-<pid>.jsonl``: start and end time, round (flexrun round, torchrun
restart count, or live-mode epoch), world size, rank, global step (1-based), data epoch
and the sample ids this rank consumed. At start it appends a ``resume`` line (the step it
resumed from). Rank 0 writes the final model state to ``--final``. It does not judge
anything (``flexrun.testing.invariants`` does) and knows nothing about the faults.

Runs unchanged under ``flexrun run`` (restart mode), ``flexrun run --mode live`` (with
``--live-loop``: :class:`flexrun.train.live.LiveLoop`), ``torchrun`` and plain ``python``
(one process: the reference run). With ``--live-loop --shards S`` (under ``flexrun run --mode
live --live-shards S``) the model is an HSDP one: FSDP2 over the worker's replica group
(``shard_mesh()``), replicas across groups; each rank then writes its final shard of the
model and optimizer state to ``--shard-out`` (``shard<i>-<pid>.pt``, the layout
:mod:`flexrun.testing.shard_states` reads) instead of rank 0 writing ``--final``.

Two hooks exist only for chaos testing: ``--enospc-flag PATH`` makes every checkpoint file
write fail with ENOSPC while PATH exists (a full disk without root), and
``--frozen-shard N`` deliberately breaks resharding (the sampler keeps splitting as if
the world had N ranks), which the exactly-once check must catch.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import flexrun.train as ft
from flexrun.live_protocol import ENV_SHARD
from flexrun.train.storage import LocalStorage

NUM_FEATURES = 16
NUM_CLASSES = 4


class EnospcStorage(LocalStorage):
    """Local storage whose file writes fail with ENOSPC while a flag file exists."""

    def __init__(self, flag: str) -> None:
        self.flag = flag

    def write_file(self, path: str, writer: Any) -> tuple[int, str]:
        if os.path.exists(self.flag):

            def writer(_f: Any, _path: str = path) -> None:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), _path)

        return super().write_file(path, writer)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="flexrun chaos workload")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--samples", type=int, default=256, help="dataset size")
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt-dir", default=None)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument(
        "--durable-every",
        type=int,
        default=0,
        help="restart mode: save every step to the checkpoint memory tier, durably every N "
        "steps (Checkpointer(durable_every=N)); 0: a durable save every --ckpt-every steps",
    )
    p.add_argument("--log-dir", required=True, help="step logs go here (steps-<pid>.jsonl)")
    p.add_argument("--final", default=None, help="rank 0 writes the final state_dict here")
    p.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step")
    p.add_argument(
        "--live-loop",
        "--live",
        dest="live",
        action="store_true",
        help="use LiveLoop (flexrun --mode live). Launchers pass --live-loop: `flexrun run` "
        "refuses a script argument that abbreviates two of its own options (as torchrun's "
        "parser does), and --live abbreviates --live-shards and --live_shards",
    )
    p.add_argument("--enospc-flag", default=None)
    p.add_argument(
        "--linger-on-preempt",
        type=float,
        default=0.0,
        help="local rank 1 sleeps this long after an agreed preemption stop before it exits "
        "(a slow interpreter teardown, for tests)",
    )
    p.add_argument("--frozen-shard", type=int, default=0, help="BROKEN on purpose if > 0")
    p.add_argument("--shards", type=int, default=1, help="live: FSDP2 shards per replica group")
    p.add_argument("--shard-out", default=None, help="live, --shards > 1: final shards here")
    return p.parse_args(argv)


def _data(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234 + args.seed)
    xs = torch.randn(args.samples, NUM_FEATURES, generator=g, dtype=torch.float64)
    ys = torch.randint(0, NUM_CLASSES, (args.samples,), generator=g)
    return xs, ys


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(NUM_FEATURES, 32), torch.nn.Tanh(), torch.nn.Linear(32, NUM_CLASSES)
    ).to(torch.float64)


class StepLog:
    """One append-only JSONL file per process (no interleaving between writers)."""

    def __init__(self, log_dir: str) -> None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        self.path = os.path.join(log_dir, f"steps-{os.getpid()}.jsonl")
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, **rec: Any) -> None:
        rec.setdefault("pid", os.getpid())
        os.write(self.fd, (json.dumps(rec, separators=(",", ":")) + "\n").encode())

    def close(self) -> None:
        os.close(self.fd)


def _save_final(model: torch.nn.Module, path: str | None) -> None:
    if path:
        tmp = f"{path}.tmp-{os.getpid()}"
        torch.save(model.state_dict(), tmp)
        os.replace(tmp, path)


def _save_shard(model: torch.nn.Module, opt: torch.optim.Optimizer, out: str | None) -> None:
    """This rank's local shard of the model and optimizer state (atomically)."""
    from flexrun.train.live import state_checksum

    if not out:
        return
    os.makedirs(out, exist_ok=True)

    def loc(v: Any) -> Any:
        return v.to_local() if hasattr(v, "to_local") else v

    state = {
        "model": {k: loc(v) for k, v in model.state_dict().items()},
        "optim": {
            i: {k: loc(v) for k, v in st.items()} for i, st in opt.state_dict()["state"].items()
        },
        "checksum": state_checksum(model),
    }
    shard = int(os.environ[ENV_SHARD])
    path = os.path.join(out, f"shard{shard}-{os.getpid()}.pt")
    torch.save(state, f"{path}.tmp")
    os.replace(f"{path}.tmp", path)


def run_restart_mode(args: argparse.Namespace, log: StepLog) -> int:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    ctx = ft.init()
    xs, ys = _data(args)
    model = _model(args.seed)
    # No bucket rebuild (find_unused_parameters=True keeps the first iteration's layout):
    # DDP otherwise re-lays its gradient buckets after its first iteration, in the order the
    # gradients became ready, so the first step after a resume reduces each element at another
    # offset than an uninterrupted run's steps do; gloo's ring sums an element in an order set
    # by its offset, and at 3+ ranks the last bits differ (the same-world invariant then fails
    # for torchrun and restart mode alike; 2 ranks sum commutatively).
    ddp = DDP(model, find_unused_parameters=True) if ctx.world_size > 1 else None
    net = ddp if ddp is not None else model
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    if args.frozen_shard > 0:
        shard_world, shard_rank = args.frozen_shard, ctx.rank % args.frozen_shard
    else:
        shard_world, shard_rank = ctx.world_size, ctx.rank
    sampler = ft.ElasticSampler(
        args.samples,
        global_batch_size=args.global_batch,
        rank=shard_rank,
        world_size=shard_world,
        seed=args.seed,
    )
    plan = ft.BatchPlan(
        global_batch_size=args.global_batch,
        micro_batch_size=args.micro_batch,
        world_size=ctx.world_size,
    )
    ckpt = None
    step = 0
    if args.ckpt_dir:
        storage = EnospcStorage(args.enospc_flag) if args.enospc_flag else None
        ckpt = ft.Checkpointer(
            args.ckpt_dir,
            keep_last=3,
            storage=storage,
            durable_every=args.durable_every or None,
        )
        ckpt.register("model", model)
        ckpt.register("optim", opt)
        ckpt.register("sampler", sampler)
        loaded = ckpt.load()
        step = loaded.step if loaded else 0
    guard = ft.PreemptionGuard(signals=(signal.SIGTERM,))
    log.write(resume=step, ts=time.time(), round=ctx.round, world=ctx.world_size, rank=ctx.rank)
    while step < args.steps:
        if sampler.exhausted:
            sampler.set_epoch(sampler.epoch + 1)
        for ids in sampler:
            t0 = time.time()
            n = sampler.step_samples()
            idx = torch.tensor(ids, dtype=torch.long)
            for i, sl in enumerate(plan.micro_slices(len(ids), n)):
                last = i == plan.accumulation_steps(n) - 1
                sync = contextlib.nullcontext() if last or ddp is None else ddp.no_sync()
                with sync:
                    part = idx[sl]
                    loss = F.cross_entropy(net(xs[part]), ys[part], reduction="sum")
                    (loss * plan.loss_scale(n)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if args.step_sleep:
                time.sleep(args.step_sleep)
            log.write(
                t0=t0,
                ts=time.time(),
                round=ctx.round,
                world=ctx.world_size,
                rank=ctx.rank,
                step=step + 1,
                epoch=sampler.epoch,
                ids=ids,
            )
            sampler.advance(n)
            step += 1
            ft.report_progress(step)
            stopping = guard.should_stop()
            last = step == args.steps
            if ckpt is not None and args.durable_every:
                # Every step to memory; durable every N steps, at the end and on a stop.
                ckpt.save(step, blocking=last or stopping)
            elif ckpt is not None and (step % args.ckpt_every == 0 or last):
                ckpt.save(step, blocking=last)
            elif ckpt is not None and stopping:
                ckpt.save(step, blocking=True)
            if stopping:
                if ckpt is not None:
                    ckpt.close()
                ft.shutdown()
                if args.linger_on_preempt and ctx.local_rank == 1:
                    time.sleep(args.linger_on_preempt)
                guard.exit(step=step)
            if step >= args.steps or sampler.exhausted:
                break
    if ckpt is not None:
        ckpt.close()
    if ctx.is_main:
        _save_final(model, args.final)
    log.write(done=True, ts=time.time(), round=ctx.round, rank=ctx.rank, step=step)
    ft.shutdown()
    return 0


def run_live_mode(args: argparse.Namespace, log: StepLog) -> int:
    from torch.utils.data import TensorDataset

    from flexrun.train.live import LiveLoop

    torch.set_num_threads(1)
    xs, ys = _data(args)
    model = _model(args.seed)
    if args.shards > 1:
        from torch.distributed.fsdp import fully_shard

        from flexrun.train.live import shard_mesh

        mesh = shard_mesh("cpu")  # (this worker's replica group; the loop forms the rest)
        for layer in model.modules():
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    loop = LiveLoop(
        model,
        opt,
        TensorDataset(xs, ys),
        global_batch=args.global_batch,
        steps=args.steps,
        seed=args.seed,
        checkpoint_dir=args.ckpt_dir,
        checkpoint_every=args.ckpt_every if args.ckpt_dir else 0,
    )
    log.write(resume=-1, ts=time.time(), round=-1, world=-1, rank=-1)
    for step in loop:
        t0 = time.time()
        for xb, yb in step.batches(micro_batch=args.micro_batch):
            step.backward(F.cross_entropy(model(xb), yb))
        if args.step_sleep:
            time.sleep(args.step_sleep)
        log.write(
            t0=t0,
            ts=time.time(),
            round=loop.epoch.number if loop.epoch else -1,
            world=step.world_size,
            rank=step.rank,
            step=step.number + 1,
            epoch=step.number * args.global_batch // args.samples,
            ids=step.indices,
        )
    if args.shards > 1:
        _save_shard(model, opt, args.shard_out)
    elif loop.rank == 0:
        _save_final(model, args.final)
    log.write(
        done=True,
        ts=time.time(),
        round=loop.epoch.number if loop.epoch else -1,
        rank=loop.rank,
        step=loop.committed,
    )
    loop.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log = StepLog(args.log_dir)
    try:
        return run_live_mode(args, log) if args.live else run_restart_mode(args, log)
    finally:
        log.close()


if __name__ == "__main__":
    sys.exit(main())
