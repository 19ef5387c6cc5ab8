"""Comparing the final states of a sharded live job, shard by shard (tests and bench).

Owns the reading of the per-rank final states that examples/train_live_hsdp.py writes
(``shard<i>-<pid>.pt``: the rank's local model shards, its local optimizer state, its
checksum) and their bitwise comparison; it runs nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def read_shards(out: Path) -> dict[int, list[dict[str, Any]]]:
    """Shard index -> the final state each of its replicas wrote into ``out``."""
    got: dict[int, list[dict[str, Any]]] = {}
    for f in sorted(out.glob("shard*-*.pt")):
        shard = int(f.name[len("shard") :].split("-", 1)[0])
        got.setdefault(shard, []).append(torch.load(f, weights_only=True))
    return got


def same_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """The model shards and every optimizer state tensor bitwise equal (same keys)."""
    if a["model"].keys() != b["model"].keys() or a["optim"].keys() != b["optim"].keys():
        return False
    if not all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"]):
        return False
    for i, st in a["optim"].items():
        other = b["optim"][i]
        if st.keys() != other.keys():
            return False
        for k, v in st.items():
            same = torch.equal(v, other[k]) if isinstance(v, torch.Tensor) else v == other[k]
            if not same:
                return False
    return True


def equal_runs(got: dict[int, list[dict[str, Any]]], ref: dict[int, list[dict[str, Any]]],
               replicas: int) -> bool:  # fmt: skip
    """Every shard of ``got`` has ``replicas`` replicas, each bitwise equal to ``ref``'s."""
    if not ref or sorted(got) != sorted(ref):
        return False
    return all(
        len(got[i]) == replicas and all(same_state(ref[i][0], r) for r in got[i]) for i in ref
    )


__all__ = ["equal_runs", "read_shards", "same_state"]
