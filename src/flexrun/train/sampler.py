"""ElasticSampler: the data position of a run, exact across restarts and resizes.

Owns the global order of samples in each epoch (a permutation drawn from ``seed`` and the
epoch, identical on every rank and at every world size), the progress counter (global
samples consumed in the epoch, advanced by the training loop once a step is done), and
how the remaining samples are split among the current ranks. It does not load data
(``DataLoader`` does, with this as its ``batch_sampler``) nor weigh the loss
(``flexrun.train.batch`` does).

Each iteration yields this rank's share of one global step: the next
``global_batch_size`` samples of the order (fewer at the end of an epoch), split by
position ``i % world_size``. Because a step's global batch depends only on the progress
counter, a run that restarts at another world size consumes exactly the samples it had
not, each once, in the same global batches.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from flexrun.errors import CheckpointError, ConfigError


class ElasticSampler:
    """Batch sampler yielding, per global step, this rank's list of sample indices."""

    def __init__(
        self,
        num_samples: int,
        *,
        global_batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
    ) -> None:
        """
        Args:
            num_samples: dataset length.
            global_batch_size: samples per optimizer step across all ranks.
            rank: this rank (the sampler's share).
            world_size: current number of ranks.
            seed: with the epoch, determines the order.
            shuffle: permute each epoch (else natural order).
            drop_last: skip an epoch's final partial global batch.

        Raises:
            ConfigError: non-positive sizes or a rank outside the world.
        """
        if num_samples < 1 or global_batch_size < 1 or world_size < 1:
            raise ConfigError("num_samples, global_batch_size and world_size must be >= 1")
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} not in [0, {world_size})")
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0
        self.consumed = 0
        """Global samples of ``epoch`` consumed by completed steps."""

    # -- order and progress -------------------------------------------------------------

    def order(self, epoch: int | None = None) -> list[int]:
        """The global sample order of ``epoch`` (default: the current one)."""
        e = self.epoch if epoch is None else epoch
        if not self.shuffle:
            return list(range(self.num_samples))
        g = torch.Generator()
        g.manual_seed(self.seed * 1_000_003 + e)
        return torch.randperm(self.num_samples, generator=g).tolist()

    @property
    def epoch_samples(self) -> int:
        """Samples an epoch consumes (all of them unless ``drop_last``)."""
        if self.drop_last:
            return self.num_samples - self.num_samples % self.global_batch_size
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Move to ``epoch``; progress resets only when the epoch actually changes."""
        if epoch != self.epoch:
            self.epoch = epoch
            self.consumed = 0

    def step_samples(self, consumed: int | None = None) -> int:
        """Global samples in the step starting at ``consumed`` (default: current position)."""
        c = self.consumed if consumed is None else consumed
        return max(0, min(self.global_batch_size, self.epoch_samples - c))

    def advance(self, num_samples: int | None = None) -> None:
        """Record that a step finished (call on every rank, after the optimizer step).

        Args:
            num_samples: global samples the step consumed (default: one full step).
        """
        n = self.step_samples() if num_samples is None else num_samples
        self.consumed = min(self.epoch_samples, self.consumed + n)

    @property
    def exhausted(self) -> bool:
        """True when every sample of the current epoch has been consumed."""
        return self.consumed >= self.epoch_samples

    def remaining_steps(self) -> int:
        """Global steps left in the current epoch."""
        left = self.epoch_samples - self.consumed
        return -(-left // self.global_batch_size)

    def __len__(self) -> int:
        return self.remaining_steps()

    def __iter__(self) -> Iterator[list[int]]:
        """This rank's share of each remaining step of the epoch, from the current position.

        A share can be empty only in an epoch's last step when it holds fewer samples than
        there are ranks.
        """
        order = self.order()
        pos = self.consumed
        end = self.epoch_samples
        while pos < end:
            step = order[pos : min(pos + self.global_batch_size, end)]
            yield step[self.rank :: self.world_size]
            pos += len(step)

    def global_step_indices(self, consumed: int | None = None) -> list[int]:
        """All ranks' samples of the step starting at ``consumed`` (for logs and tests)."""
        c = self.consumed if consumed is None else consumed
        return self.order()[c : c + self.step_samples(c)]

    # -- checkpoint ---------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "consumed": self.consumed,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "global_batch_size": self.global_batch_size,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the position; world size and rank stay those of this run.

        Raises:
            CheckpointError: the saved order was for another dataset, seed or batch size.
        """
        for key in ("seed", "num_samples", "global_batch_size", "shuffle", "drop_last"):
            if key in state and state[key] != getattr(self, key):
                raise CheckpointError(
                    f"sampler checkpoint has {key}={state[key]!r}, this run {getattr(self, key)!r}"
                )
        self.epoch = int(state["epoch"])
        self.consumed = int(state["consumed"])
