"""The torchrun side of bench_recovery's HSDP case: plain HSDP (FSDP2 on a (replicate, shard)
mesh) with torch.distributed.checkpoint (DCP) saves and a resume from the newest one, as a
torchtitan-style script does it; the model is examples/train_live_hsdp.py's.

    torchrun --standalone --nproc-per-node 4 --max-restarts 3 bench/hsdp_dcp_steps.py \\
        --shards 2 --ckpt-dir /tmp/ck --ckpt-every 5

Each completed step appends one JSON line to ``--progress`` (step, rank, pid, attempt); a
resume first appends one with ``restoring`` (the checkpoint's step) instead of ``step``.
A checkpoint counts once its ``done`` marker exists (written after every rank's save), so
a kill during a save never leaves a torn checkpoint to resume from.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh

_EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_live_hsdp.py"


def _example() -> Any:
    """examples/train_live_hsdp.py as a module (its model, optimizer and data)."""
    spec = importlib.util.spec_from_file_location("train_live_hsdp", _EXAMPLE)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--ckpt-every", type=int, default=5)
    p.add_argument("--progress", default="")
    a = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(
        "cpu", (world // a.shards, a.shards), mesh_dim_names=("replicate", "shard")
    )
    example = _example()
    model, opt = example.sharded(a.dim, a.blocks, mesh)  # (on the 2-D mesh: HSDP)
    x, y = example.samples(a.dim)

    root = Path(a.ckpt_dir)
    done = sorted(int(d.name.split("-")[1]) for d in root.glob("step-*") if (d / "done").exists())
    start = 0
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if done:
        start = done[-1]
        if a.progress:  # (a line with no "step": the bench's marker of a restore under way)
            row = {"ts": time.time(), "restoring": start, "rank": rank, "pid": os.getpid(),
                   "attempt": attempt}  # fmt: skip
            with open(a.progress, "a") as fh:
                fh.write(json.dumps(row) + "\n")
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=str(root / f"step-{start}"))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])

    per = a.global_batch // world
    for step in range(start, a.steps):
        idx = torch.randperm(1024, generator=torch.Generator().manual_seed(step))[: a.global_batch]
        mine = idx[rank * per : (rank + 1) * per]
        loss = torch.nn.functional.mse_loss(model(x[mine]), y[mine])
        loss.backward()
        opt.step()
        opt.zero_grad()
        if a.ckpt_every and (step + 1) % a.ckpt_every == 0:
            msd, osd = get_state_dict(model, opt)
            target = root / f"step-{step + 1}"
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(target))
            dist.barrier()
            if rank == 0:
                (target / "done").touch()
        if a.progress:
            row = {"ts": time.time(), "step": step, "rank": rank, "pid": os.getpid(),
                   "attempt": attempt}  # fmt: skip
            with open(a.progress, "a") as fh:
                fh.write(json.dumps(row) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
