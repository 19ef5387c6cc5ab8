"""Process-group lifecycle for a training script: ``init()`` and ``shutdown()``.

Owns forming (and tearing down) the default process group from the worker environment
and the small frozen :class:`TrainContext` that the rest of ``flexrun.train`` takes as an
argument. Backend: nccl when CUDA is available, gloo otherwise. It does not read the
environment itself (``flexrun.train.env`` does) and does not know about checkpoints.
A process started without ``MASTER_ADDR``/``MASTER_PORT`` (plain ``python train.py``) runs
single-process with no process group, so the same script works everywhere.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from flexrun.errors import ConfigError
from flexrun.train.env import WorkerEnv, read_env
from flexrun.train.progress import install_stack_dump


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainContext:
    """Where this worker stands in the job."""

    rank: int
    """Global rank."""
    world_size: int
    """Number of workers in this round."""
    local_rank: int
    """Rank on this node."""
    device: torch.device
    """``cuda:<local_rank>`` when CUDA is available, else ``cpu``."""
    restart_count: int
    """How many times the launcher restarted the workers."""
    round: int
    """Round number (flexrun) or restart count (torchrun); fences checkpoint writes."""
    run_dir: str | None
    """Run directory holding ``events.jsonl``, or ``None`` when not set."""
    run_id: str
    """Run id, for event records."""
    node: str
    """Node name, for event records."""
    backend: str | None
    """Process-group backend, or ``None`` when running single-process."""
    memory_dir: str | None = None
    """Host memory the node's agent owns for the checkpoint memory tier, or ``None``."""

    @property
    def is_main(self) -> bool:
        """True on rank 0, the one writer of non-sharded checkpoints and events."""
        return self.rank == 0


_lock = threading.Lock()
_current: TrainContext | None = None
_owns_group = False


def init(
    *,
    env: WorkerEnv | None = None,
    backend: str | None = None,
    run_dir: str | None = None,
    timeout_s: float = 300.0,
) -> TrainContext:
    """Form the default process group (if the environment asks for one) and return the context.

    Idempotent: a second call returns the first call's context. If the script already
    called ``dist.init_process_group()``, that group is used as is.

    Args:
        env: the worker environment; read from ``os.environ`` when omitted.
        backend: override the backend choice (nccl with CUDA, else gloo).
        run_dir: run directory for events; overrides ``FLEXRUN_RUN_DIR``.
        timeout_s: collective timeout of the group.

    Raises:
        ConfigError: the environment is malformed or names more than one worker without
            a rendezvous address.
    """
    global _current, _owns_group
    install_stack_dump()
    with _lock:
        if _current is not None:
            return _current
        env = env or read_env()
        cuda = torch.cuda.is_available()
        device = torch.device(f"cuda:{env.local_rank}") if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        chosen: str | None = None
        if dist.is_available() and dist.is_initialized():
            chosen = str(dist.get_backend())
        elif env.distributed:
            chosen = backend or ("nccl" if cuda else "gloo")
            dist.init_process_group(
                backend=chosen,
                init_method=f"tcp://{env.master_addr}:{env.master_port}",
                rank=env.rank,
                world_size=env.world_size,
                timeout=timedelta(seconds=timeout_s),
            )
            _owns_group = True
        elif env.world_size > 1:
            raise ConfigError(
                f"WORLD_SIZE={env.world_size} but MASTER_ADDR/MASTER_PORT are not set; "
                "launch with torchrun or flexrun run"
            )
        _current = TrainContext(
            rank=env.rank,
            world_size=env.world_size,
            local_rank=env.local_rank,
            device=device,
            restart_count=env.restart_count,
            round=env.round,
            run_dir=run_dir if run_dir is not None else env.run_dir,
            run_id=env.run_id,
            node=env.node,
            backend=chosen,
            memory_dir=env.memory_dir,
        )
        return _current


def current() -> TrainContext | None:
    """The context returned by :func:`init`, or ``None`` before it (or after shutdown)."""
    return _current


_RETIRE_S = 0.05
"""How long shutdown() releases the GIL for gloo's threads to retire finished work."""


def shutdown() -> None:
    """Destroy the process group that :func:`init` formed. Idempotent; collective.

    Call it on every rank before the script ends (also before exiting on preemption).
    """
    global _current, _owns_group
    with _lock:
        if _owns_group and dist.is_available() and dist.is_initialized():
            # Let gloo's worker threads retire every finished collective first. Otherwise a
            # process group freed later under the GIL (e.g. by DDP's reducer at exit) joins
            # a thread that is itself waiting for the GIL to free a work's tensors: a
            # deadlock at interpreter exit (seen with torch 2.13, about 1 run in 10).
            # The barrier's wait releases the GIL, so those threads can finish; the barrier's
            # own work is retired by the same thread after it completes, which needs the GIL
            # once more: the short sleep releases it (a hang after the barrier was seen once
            # with examples/train_elastic.py under torchrun).
            dist.barrier()
            time.sleep(_RETIRE_S)
            dist.destroy_process_group()
        _owns_group = False
        _current = None


def single_process_context(*, run_dir: str | None = None, round: int = 0) -> TrainContext:
    """A context for one process without a process group (tests, tools, notebooks)."""
    return TrainContext(
        rank=0,
        world_size=1,
        local_rank=0,
        device=torch.device("cpu"),
        restart_count=0,
        round=round,
        run_dir=run_dir,
        run_id="local",
        node="local",
        backend=None,
    )
