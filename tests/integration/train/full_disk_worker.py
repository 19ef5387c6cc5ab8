"""A 2-rank worker whose checkpoint disk is full (injected ENOSPC) for the whole run.

Usage: full_disk_worker.py CKPT_DIR FLAG MAX_FAILED STEPS. Each step all-reduces a tensor
(as training would) and saves every 2 steps in the background. Prints one JSON line per
rank: the step at which ``save()`` raised ``CheckpointError`` (exit 3), or that it finished
(exit 0). The test checks that every rank raises at the same step instead of the writer
raising alone and its peers waiting in their next collective.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

import flexrun.train as ft
from flexrun.errors import CheckpointError
from flexrun.testing.chaos_workload import EnospcStorage


def main() -> int:
    ckpt_dir, flag, max_failed, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    ctx = ft.init(timeout_s=60)
    model = torch.nn.Linear(8, 8)
    ckpt = ft.Checkpointer(
        ckpt_dir,
        storage=EnospcStorage(flag),
        max_failed_saves=max_failed,
        failed_saves_grace_s=0,
    )
    ckpt.register("model", model)
    step = 0
    try:
        for step in range(1, steps + 1):
            t = torch.ones(1)
            dist.all_reduce(t)
            if step % 2 == 0:
                ckpt.save(step)
        ckpt.close()
    except CheckpointError as exc:
        print(json.dumps({"rank": ctx.rank, "raised_at": step, "error": str(exc)}), flush=True)
        ft.shutdown()
        return 3
    print(json.dumps({"rank": ctx.rank, "finished": step}), flush=True)
    ft.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
