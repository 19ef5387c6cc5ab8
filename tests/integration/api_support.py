"""Callables for tests/integration/test_api.py: importable by the workers by name."""

from __future__ import annotations

import os


def rank_value(base: int, *, scale: int = 1) -> dict[str, int]:
    rank = int(os.environ["RANK"])
    return {"rank": rank, "value": base + scale * rank, "world": int(os.environ["WORLD_SIZE"])}


def fail_on_rank(bad: int) -> int:
    rank = int(os.environ["RANK"])
    if rank == bad:
        raise ValueError(f"rank {rank} refuses this batch")
    return rank
