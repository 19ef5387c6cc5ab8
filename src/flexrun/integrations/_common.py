"""What the library integrations share: an epoch-length sampler, the worker's context and
the agreed stop.

Owns :class:`EpochSampler` (an :class:`~flexrun.train.sampler.ElasticSampler` whose length
is a whole epoch's steps, as library loops that count batches from the epoch's start expect),
a :class:`~flexrun.train.context.TrainContext` read from the worker environment without
forming a process group (the library forms it), and :class:`AgreedStop` (a
:class:`~flexrun.train.preempt.PreemptionGuard` that asks every rank over the library's
process group). It does not import any training library.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from flexrun.train.context import TrainContext, current
from flexrun.train.env import read_env
from flexrun.train.preempt import PreemptionGuard
from flexrun.train.sampler import ElasticSampler


class EpochSampler(ElasticSampler):
    """An :class:`ElasticSampler` whose ``len()`` is the steps of a whole epoch.

    Library loops (HF ``Trainer``, Lightning) size an epoch by ``len(loader)`` once and then
    count the batches of the epoch they restored from a checkpoint on top of it; a length of
    the remaining steps would end a resumed epoch early.
    """

    def __len__(self) -> int:
        return -(-self.epoch_samples // self.global_batch_size)

    def place(self, rank: int, world_size: int) -> None:
        """Take this run's rank and world size (the order and position do not depend on them)."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} not in [0, {world_size})")
        self.rank, self.world_size = rank, world_size


def worker_context() -> TrainContext:
    """The worker's context from its environment (``RANK``, ``WORLD_SIZE``, ``FLEXRUN_*``),
    whether or not a process group exists yet: libraries form their own."""
    ctx = current()
    if ctx is not None:
        return ctx
    env = read_env()
    cuda = torch.cuda.is_available()
    return TrainContext(
        rank=env.rank,
        world_size=env.world_size,
        local_rank=env.local_rank,
        device=torch.device(f"cuda:{env.local_rank}") if cuda else torch.device("cpu"),
        restart_count=env.restart_count,
        round=env.round,
        run_dir=env.run_dir,
        run_id=env.run_id,
        node=env.node,
        backend=None,
    )


def agreed(guard: PreemptionGuard) -> bool:
    """Whether any rank was told to stop. Collective over the default group (the library's)
    when it exists; every rank calls it at the same point of every step."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return guard.should_stop()
    return guard.requested


def barrier() -> None:
    """Wait for every rank (no-op without a process group)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
