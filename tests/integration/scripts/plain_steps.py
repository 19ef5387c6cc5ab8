"""A plain torchrun-style DDP script (no flexrun imports) for the hang and crash-loop tests.

``--hang-at S``: rank 1 sleeps forever inside step S, once in the whole job (``--marker``
is created first). ``--first-step-sleep T``: every rank spends T seconds in its first
step (compilation, data warm-up). ``--fail-after N``: rank 0 raises after N completed steps
on every attempt (0: before its first step, a crash loop). ``--progress``: one JSON line
per completed step.
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=40)
p.add_argument("--step-time", type=float, default=0.05)
p.add_argument("--hang-at", type=int, default=-1)
p.add_argument("--marker", default="")
p.add_argument("--first-step-sleep", type=float, default=0.0)
p.add_argument("--fail-after", type=int, default=-1)
p.add_argument("--progress", default="")
a = p.parse_args()


def sleep_forever_in_step() -> None:
    while True:
        time.sleep(3600)


dist.init_process_group("gloo")
rank = dist.get_rank()
model = DDP(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(a.steps):
    if step == a.fail_after and rank == 0:
        raise RuntimeError(f"deliberate failure after {step} steps")
    if step == 0 and a.first_step_sleep:
        time.sleep(a.first_step_sleep)
    if step == a.hang_at and rank == 1 and not os.path.exists(a.marker):
        open(a.marker, "w").close()
        sleep_forever_in_step()
    loss = model(torch.randn(16, 8)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    time.sleep(a.step_time)
    if a.progress:
        with open(a.progress, "a") as fh:
            fh.write(
                json.dumps({"ts": time.time(), "rank": rank, "step": step, "pid": os.getpid()})
                + "\n"
            )
dist.destroy_process_group()
