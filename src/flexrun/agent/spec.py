"""The worker environment contract (ARCHITECTURE.md, Contracts): pure data building.

Owns the names and values of every variable a worker sees; spawns nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from flexrun.rendezvous.state import MasterRecord, RoundRecord

# Variables the agent sets for itself that must not leak into workers unless the user set them.
_AGENT_ONLY = ("TORCH_CPP_LOG_LEVEL",)


def worker_envs(
    *,
    base: Mapping[str, str],
    rnd: RoundRecord,
    node_id: str,
    nproc: int,
    master: MasterRecord,
    role: str,
    run_id: str,
    run_dir: Path,
    restart_count: int,
    max_restarts: int,
) -> list[dict[str, str]]:
    """One environment per local rank for round ``rnd``."""
    group_rank = rnd.group_rank(node_id)
    if group_rank is None:
        raise ValueError(f"{node_id} is not in round {rnd.number}")
    world = rnd.world_size()
    base_rank = rnd.rank_base(node_id)
    envs = []
    for local_rank in range(nproc):
        env = {
            k: v
            for k, v in base.items()
            if k not in _AGENT_ONLY or k in base.get("FLEXRUN_KEEP_ENV", "")
        }
        rank = base_rank + local_rank
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(local_rank),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(nproc),
            GROUP_RANK=str(group_rank),
            GROUP_WORLD_SIZE=str(len(rnd.members)),
            ROLE_NAME=role,
            ROLE_RANK=str(rank),
            ROLE_WORLD_SIZE=str(world),
            MASTER_ADDR=master.addr,
            MASTER_PORT=str(master.port),
            TORCHELASTIC_RESTART_COUNT=str(restart_count),
            TORCHELASTIC_MAX_RESTARTS=str(max_restarts),
            TORCHELASTIC_RUN_ID=run_id,
            # Rank 0 hosts this round's fresh process-group store at MASTER_PORT.
            TORCHELASTIC_USE_AGENT_STORE="False",
            FLEXRUN_ROUND=str(rnd.number),
            FLEXRUN_RUN_DIR=str(run_dir),
            FLEXRUN_RUN_ID=run_id,
            FLEXRUN_NODE=node_id,
        )
        env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        if nproc > 1:
            env.setdefault("OMP_NUM_THREADS", "1")
        envs.append(env)
    return envs
