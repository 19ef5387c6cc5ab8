"""Sharded-checkpoint worker for test_train_sharded.py: DTensor state saved at one world
size and loaded at another through flexrun.train.sharded (DCP)."""

from __future__ import annotations

import json
import sys

import torch

import flexrun.train as ft
from flexrun.train.sharded import ShardedCheckpointer


class Holder:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"t": self.t}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.t = state["t"]


def main() -> None:
    mode, root = sys.argv[1], sys.argv[2]
    ctx = ft.init()
    full = torch.arange(64, dtype=torch.float32).reshape(16, 4)
    if ctx.world_size > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (ctx.world_size,))
        value = full if mode == "save" else torch.zeros_like(full)
        t = distribute_tensor(value, mesh, [Shard(0)])
    else:
        t = full.clone() if mode == "save" else torch.zeros_like(full)
    torch.manual_seed(1)
    model = torch.nn.Linear(4, 3)
    if mode != "save":
        with torch.no_grad():
            model.weight.zero_()
    holder = Holder(t)
    ck = ShardedCheckpointer(root)
    ck.register("tensor", holder)
    ck.register("model", model)
    if mode == "save":
        ck.save(5, extra={"epoch": 2})
        out = {"saved": ck.steps()}
    else:
        loaded = ck.load()
        got = holder.t.full_tensor() if hasattr(holder.t, "full_tensor") else holder.t
        torch.manual_seed(1)
        ref = torch.nn.Linear(4, 3)
        out = {
            "step": loaded.step if loaded else None,
            "extra": loaded.extra if loaded else None,
            "saved_world": loaded.world_size if loaded else None,
            "tensor_ok": bool(torch.equal(got, full)),
            "model_ok": bool(torch.equal(model.weight, ref.weight)),
        }
    print("RESULT " + json.dumps(out), flush=True)
    ft.shutdown()


if __name__ == "__main__":
    main()
