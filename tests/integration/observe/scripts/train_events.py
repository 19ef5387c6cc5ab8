"""A torchrun-style DDP script that reports what ``flexrun.train`` reports to the event log.

Rank 0 appends ``train_metrics`` (step, steps/s, samples/s) and ``checkpoint_saved``
events to ``$FLEXRUN_RUN_DIR/events.jsonl`` the way the train library does, checkpoints
every ``--ckpt-every`` steps and resumes from it. Every rank appends a progress line per
step. All ranks stop together (an all-reduce of a flag) once ``--stop-file`` exists, so
the job ends with exit code 0.
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from flexrun.events import EventLog

p = argparse.ArgumentParser()
p.add_argument("--step-time", type=float, default=0.05)
p.add_argument("--batch", type=int, default=8)
p.add_argument("--ckpt", required=True)
p.add_argument("--ckpt-every", type=int, default=20)
p.add_argument("--progress", required=True)
p.add_argument("--stop-file", required=True)
p.add_argument("--metrics-every-s", type=float, default=0.5)
a = p.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
rnd = int(os.environ.get("FLEXRUN_ROUND", "0"))
events = EventLog(
    os.environ["FLEXRUN_RUN_DIR"],
    run_id=os.environ["FLEXRUN_RUN_ID"],
    node=os.environ["FLEXRUN_NODE"],
)
events.round = rnd

model = DDP(torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
step = 0
if os.path.exists(a.ckpt):
    state = torch.load(a.ckpt, weights_only=True)
    model.module.load_state_dict(state["model"])
    step = int(state["step"])
    if rank == 0:
        events.emit("checkpoint_loaded", rank=0, step=step)

gen = torch.Generator().manual_seed(rank)
window_t, window_steps = time.monotonic(), 0
while True:
    flag = torch.tensor([1.0 if os.path.exists(a.stop_file) else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() > 0:
        break
    loss = model(torch.randn(a.batch, 16, generator=gen)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    time.sleep(a.step_time)
    step += 1
    window_steps += 1
    line = json.dumps(
        {
            "ts": time.time(),
            "round": rnd,
            "rank": rank,
            "world": world,
            "step": step,
            "pid": os.getpid(),
        }
    )
    fd = os.open(a.progress, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, (line + "\n").encode())
    os.close(fd)
    if rank != 0:
        continue
    now = time.monotonic()
    if now - window_t >= a.metrics_every_s:
        sps = window_steps / (now - window_t)
        events.emit(
            "train_metrics",
            rank=0,
            step=step,
            steps_per_s=round(sps, 3),
            samples_per_s=round(sps * a.batch * world, 3),
            loss=round(loss.item(), 5),
        )
        window_t, window_steps = now, 0
    if step % a.ckpt_every == 0:
        t0 = time.monotonic()
        tmp = a.ckpt + ".tmp"
        torch.save({"model": model.module.state_dict(), "step": step}, tmp)
        os.replace(tmp, a.ckpt)
        events.emit(
            "checkpoint_saved",
            rank=0,
            step=step,
            bytes=os.path.getsize(a.ckpt),
            stall_s=round(time.monotonic() - t0, 4),
        )

dist.barrier()
dist.destroy_process_group()
