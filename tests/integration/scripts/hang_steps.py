"""DDP steps that report progress; rank 1 sleeps forever inside a step once (first attempt)."""

import argparse
import os
import time

import torch
import torch.distributed as dist

import flexrun.train as ft

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=30)
p.add_argument(
    "--marker", required=True, help="created before the one hang, so a restart does not hang"
)
a = p.parse_args()


def sleep_forever_in_step() -> None:
    while True:
        time.sleep(3600)


dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.ones(4)
for step in range(a.steps):
    if step == 5 and rank == 1 and not os.path.exists(a.marker):
        open(a.marker, "w").close()
        sleep_forever_in_step()
    dist.all_reduce(t)
    t /= dist.get_world_size()
    ft.report_progress(step)
    time.sleep(0.05)
dist.destroy_process_group()
