"""A plain torchrun-style DDP script (no flexrun imports), used by tests and benchmarks.

It calls ``dist.init_process_group("gloo")`` with no address, reads ``LOCAL_RANK``, resumes
from a checkpoint the way torchrun users write it by hand, and appends one JSON line per
completed step to ``--progress`` so that a test can see who trained what, when.
"""

import argparse
import json
import os
import signal
import socket
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=20)
p.add_argument("--step-time", type=float, default=0.05)
p.add_argument("--ckpt", default="")
p.add_argument("--ckpt-every", type=int, default=5)
p.add_argument("--progress", default="")
p.add_argument(
    "--step-seeded",
    action="store_true",
    help="each step's data from a generator seeded by (step, rank): a run resumed from a "
    "checkpoint sees the data an uninterrupted one saw (bitwise comparisons)",
)
p.add_argument("--final", default="", help="rank 0 writes the final parameters here")
p.add_argument("--fail-rank", type=int, default=-1, help="this rank raises ValueError at step 0")
p.add_argument(
    "--fail-once-at",
    type=int,
    default=-1,
    help="with --fail-rank: raise at this step of the first attempt only",
)
p.add_argument("--on-sigterm", default="", help="write PATH.<rank> and exit 143 on SIGTERM")
p.add_argument(
    "--import-libs",
    default="",
    help="comma-separated modules imported at start (a library's script)",
)
p.add_argument(
    "--late-restart",
    type=float,
    default=0.0,
    help="with --fail-once-at: the failed rank joins its second attempt this late",
)
a = p.parse_args()
for lib in filter(None, a.import_libs.split(",")):
    __import__(lib)


def on_sigterm(signum, frame):
    with open(f"{a.on_sigterm}.{os.environ.get('RANK')}", "w") as fh:
        fh.write(str(os.getpid()))
    sys.exit(143)


if a.on_sigterm:
    signal.signal(signal.SIGTERM, on_sigterm)

restarted = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
if a.late_restart and restarted and int(os.environ["RANK"]) == a.fail_rank:
    time.sleep(a.late_restart)  # (the others meet in the store first)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
local_rank = int(os.environ["LOCAL_RANK"])
attempt = os.environ.get("FLEXRUN_ROUND") or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")

torch.manual_seed(0)
model = DDP(torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
start = 0
if a.ckpt and os.path.exists(a.ckpt):
    state = torch.load(a.ckpt, weights_only=True)
    model.module.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    start = int(state["step"])

gen = torch.Generator().manual_seed(1234 + rank)
for step in range(start, a.steps):
    first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if rank == a.fail_rank and (a.fail_once_at < 0 or (first and step == a.fail_once_at)):
        raise ValueError(f"deliberate failure on rank {rank} at step {step}")
    if a.step_seeded:
        gen.manual_seed(1234 + 100_003 * step + rank)
    x = torch.randn(32, 16, generator=gen)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    time.sleep(a.step_time)
    if a.progress:
        line = json.dumps(
            {
                "ts": time.time(),
                "attempt": attempt,
                "rank": rank,
                "world": world,
                "local_rank": local_rank,
                "step": step,
                "pid": os.getpid(),
                "host": socket.gethostname(),
            }
        )
        fd = os.open(a.progress, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.write(fd, (line + "\n").encode())
        os.close(fd)
    if rank == 0 and a.ckpt and (step + 1) % a.ckpt_every == 0:
        tmp = a.ckpt + ".tmp"
        torch.save(
            {"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step + 1}, tmp
        )
        os.replace(tmp, a.ckpt)

if rank == 0 and a.final:
    torch.save(model.module.state_dict(), a.final + ".tmp")
    os.replace(a.final + ".tmp", a.final)
dist.barrier()
dist.destroy_process_group()
