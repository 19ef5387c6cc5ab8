"""The worker environment contract (docs/contributor/architecture.md, Contracts): pure data building.

Owns the names and values of every variable a worker sees; spawns nothing. With
``settings`` (the run's :class:`~flexrun.config.RunConfig`) it also applies what the
configuration decided for workers: the network interface defaults of a multi-host job,
``--virtual-local-rank``, and the local rank of one Slurm task per GPU. (torchrun's
``TORCHELASTIC_SIGNALS_TO_HANDLE`` is in ``WorkerSpec.environ``: torchrun
exports it from the launcher, so it is inherited.)
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from flexrun.config import ETCD_PASSWORD_ENV, SECRET_ENV, RunConfig
from flexrun.rendezvous.state import MasterRecord, RoundRecord

# Variables the agent sets for itself that must not leak into workers unless the user set them.
_AGENT_ONLY = ("TORCH_CPP_LOG_LEVEL",)
# Secret values the agent reads from its environment: never a worker's (its environment
# is readable in /proc/<pid>/environ and lands in crash reports). A live worker that
# signs gets the job secret as a file (FLEXRUN_JOB_SECRET_FILE, agent/live.py); a
# restart-mode worker reads no flexrun record and needs neither.
_NEVER = (SECRET_ENV, ETCD_PASSWORD_ENV)


def without_secrets(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` less the variables whose value is a secret (for a warm spare, which
    keeps the environment it was started with in ``/proc/<pid>/environ``)."""
    return {k: v for k, v in environ.items() if k not in _NEVER}


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
    settings: RunConfig | None = None,
    agent_store: bool = False,
    memory_dir: Path | None = None,
) -> list[dict[str, str]]:
    """One environment per local rank for round ``rnd``; ``agent_store``: the workers are
    clients of a store their agent hosts at the master (see :mod:`flexrun.agent.worker_store`);
    ``memory_dir``: the agent's directory for checkpoint copies in host memory
    (``FLEXRUN_MEMORY_DIR``, :mod:`flexrun.agent.memdir`)."""
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
            if k not in _NEVER and (k not in _AGENT_ONLY or k in base.get("FLEXRUN_KEEP_ENV", ""))
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
            TORCHELASTIC_USE_AGENT_STORE=str(agent_store),
            FLEXRUN_ROUND=str(rnd.number),
            FLEXRUN_RUN_DIR=str(run_dir),
            FLEXRUN_RUN_ID=run_id,
            FLEXRUN_NODE=node_id,
        )
        if memory_dir is not None:
            env["FLEXRUN_MEMORY_DIR"] = str(memory_dir)
        env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        if nproc > 1:
            env.setdefault("OMP_NUM_THREADS", "1")
        if settings is not None:
            apply_settings(env, settings, local_rank)
        envs.append(env)
    return envs


def apply_settings(env: dict[str, str], settings: RunConfig, local_rank: int) -> None:
    """What the run's configuration adds to local rank ``local_rank``'s environment ``env``."""
    if settings.socket_ifname:
        # gloo binds to the host name's address unless told an interface; on many hosts
        # that is a loopback address, and a multi-host job then hangs after the rendezvous.
        env.setdefault("GLOO_SOCKET_IFNAME", settings.socket_ifname)
        env.setdefault("NCCL_SOCKET_IFNAME", "=" + settings.socket_ifname)
    if settings.worker.slurm_task is not None:
        # One Slurm task per GPU: the local rank is the task's, unless the task was bound to
        # a single device (--gpus-per-task=1), which is then its device 0.
        local_id, node_tasks = settings.worker.slurm_task
        visible = settings.worker.environ.get("CUDA_VISIBLE_DEVICES")
        bound = visible is not None and len([d for d in visible.split(",") if d.strip()]) == 1
        env["LOCAL_RANK"] = "0" if bound else str(local_id)
        env["LOCAL_WORLD_SIZE"] = str(node_tasks)
    if settings.worker.virtual_local_rank:
        visible = settings.worker.environ.get("CUDA_VISIBLE_DEVICES")
        devices = [d.strip() for d in visible.split(",")] if visible is not None else None
        if devices is not None and local_rank >= len(devices):
            raise ValueError(
                f"local rank {local_rank} has no device in CUDA_VISIBLE_DEVICES={visible}"
            )
        env["LOCAL_RANK"] = "0"
        env["CUDA_VISIBLE_DEVICES"] = (
            devices[local_rank] if devices is not None else str(local_rank)
        )
