"""A live-mode training script (flexrun.train.LiveLoop) used by the live-mode tests and bench.

Appends one JSON line per step body to ``--progress`` (step, rank, world, pid, epoch,
sample ids) and, at the end, the final weights to ``--out`` (rank 0).

Fault hooks (tests only): ``--corrupt-at S --corrupt-rank R --die-rank K --once FILE``: at
step ``S``, after its backward pass, rank ``R`` perturbs its own weights (silent
corruption: the members' states now disagree) and rank ``K`` kills itself with SIGKILL, so
the next epoch has to reconcile them. ``FILE`` makes it happen once in the whole job;
both ranks first wait for ``FILE.go`` (the test creates it when it is ready).
"""

import argparse
import json
import os
import signal
import time

import torch
from torch.utils.data import TensorDataset

from flexrun.train.live import LiveLoop, state_checksum

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=30)
p.add_argument("--step-time", type=float, default=0.05)
p.add_argument("--global-batch", type=int, default=24)
p.add_argument("--progress", default="")
p.add_argument("--out", default="")
p.add_argument("--ckpt-dir", default="")
p.add_argument("--ckpt-every", type=int, default=0)
p.add_argument("--corrupt-at", type=int, default=-1)
p.add_argument("--corrupt-rank", type=int, default=1)
p.add_argument("--die-rank", type=int, default=3)
p.add_argument("--once", default="")
a = p.parse_args()

g = torch.Generator().manual_seed(42)
x = torch.randn(240, 16, generator=g)
y = x @ torch.randn(16, 1, generator=g) + 0.1 * torch.randn(240, 1, generator=g)
data = TensorDataset(x, y)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
opt = torch.optim.Adam(model.parameters(), lr=1e-2)

loop = LiveLoop(
    model,
    opt,
    data,
    global_batch=a.global_batch,
    steps=a.steps,
    seed=3,
    checkpoint_dir=a.ckpt_dir or None,
    checkpoint_every=a.ckpt_every,
)


def record(obj: dict) -> None:
    if a.progress:
        fd = os.open(a.progress, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.write(fd, (json.dumps(obj) + "\n").encode())
        os.close(fd)


for step in loop:
    for xb, yb in step.batches(micro_batch=4):
        step.backward(torch.nn.functional.mse_loss(model(xb), yb))
    if step.number == a.corrupt_at and not os.path.exists(a.once):
        deadline = time.time() + 60
        while step.rank in (a.corrupt_rank, a.die_rank) and not os.path.exists(a.once + ".go"):
            if time.time() > deadline:
                raise SystemExit("--once FILE.go never appeared")
            time.sleep(0.05)
        if step.rank == a.corrupt_rank:
            with torch.no_grad():
                next(model.parameters()).add_(1e-3)
            open(a.once + f".corrupted{step.rank}", "w").close()
        elif step.rank == a.die_rank:
            # Wait for the corruption to land first, so both faults meet in one recovery.
            deadline = time.time() + 30
            while (
                not os.path.exists(a.once + f".corrupted{a.corrupt_rank}")
                and time.time() < deadline
            ):
                time.sleep(0.01)
            open(a.once, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(a.step_time)
    record(
        {
            "ts": time.time(),
            "step": step.number,
            "rank": step.rank,
            "world": step.world_size,
            "pid": os.getpid(),
            "epoch": loop.epoch.number if loop.epoch else None,
            "ids": step.indices,
        }
    )

record(
    {
        "ts": time.time(),
        "done": True,
        "rank": loop.rank,
        "pid": os.getpid(),
        "checksum": state_checksum(model),
    }
)
if a.out and loop.rank == 0:
    torch.save(model.state_dict(), a.out)
loop.close()
