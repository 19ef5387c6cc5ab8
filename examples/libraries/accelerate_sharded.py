"""An accelerate script (bf16 autocast from the config file) whose FSDP2 model and raw Adam are
checkpointed with flexrun's ShardedCheckpointer: kill a worker and it resumes where it was.

    flexrun run --nproc-per-node 2 --max-restarts 3 \
        --accelerate-config examples/libraries/accelerate_cpu.yaml \
        --spare-preload accelerate \
        examples/libraries/accelerate_sharded.py --dir /tmp/acc-ckpt --steps 40

(Needs ``pip install 'flexrun[integrations]'``; see docs/user/libraries.md.)
"""

from __future__ import annotations

import argparse

import torch
from accelerate import Accelerator
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from flexrun.train.sharded import ShardedCheckpointer


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--save-every", type=int, default=5)
    a = p.parse_args()
    acc = Accelerator(cpu=True)  # mixed_precision comes from the config file's variables
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    mesh = init_device_mesh("cpu", (acc.num_processes,))
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ckpt = ShardedCheckpointer(a.dir, keep_last=2)
    ckpt.register("model", model)  # as they are: no state_dict wrappers needed
    ckpt.register("optim", opt)
    loaded = ckpt.load()
    start = loaded.step if loaded else 0
    acc.print(f"mixed_precision={acc.mixed_precision}, starting at step {start}")
    for step in range(start, a.steps):
        g = torch.Generator().manual_seed(step * acc.num_processes + acc.process_index)
        x = torch.randn(32, 16, generator=g)
        with acc.autocast():
            loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if (step + 1) % a.save_every == 0:
            ckpt.save(step + 1, asynchronous=True)  # training goes on while it is written
    ckpt.wait()
    acc.print(f"done at step {a.steps}, loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
