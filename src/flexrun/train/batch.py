"""Constant global batch: gradient accumulation and loss scaling for any world size.

Owns the arithmetic that keeps an optimizer step equivalent to one single-process step on
the same global batch, whatever the number of ranks: how many micro-batches each rank
runs (the same count on every rank, so gradient syncs line up), how a rank's share is cut
into them, and the factor that turns a micro-batch's *summed* per-sample loss into its
contribution to the mean over the global batch. Uneven splits are weighted by sample
count, not rejected. It does not choose samples (``ElasticSampler`` does) and does not
run the backward pass.

With DDP, which averages gradients over ``world_size`` ranks, a rank contributes
``sum(loss_i) * world_size / step_samples``; the average is then
``sum over all samples of grad(loss_i) / step_samples`` exactly, as in one process.
"""

from __future__ import annotations

from dataclasses import dataclass

from flexrun.errors import ConfigError


@dataclass(frozen=True, kw_only=True, slots=True)
class BatchPlan:
    """How one rank processes a global batch."""

    global_batch_size: int
    """Samples per optimizer step across all ranks."""
    micro_batch_size: int
    """Most samples a rank feeds through the model at once."""
    world_size: int
    """Current number of ranks."""
    grad_averaged: bool = True
    """True when the gradient all-reduce averages over ranks (DDP); False when it sums."""

    def __post_init__(self) -> None:
        if min(self.global_batch_size, self.micro_batch_size, self.world_size) < 1:
            raise ConfigError("global_batch_size, micro_batch_size and world_size must be >= 1")

    def accumulation_steps(self, step_samples: int | None = None) -> int:
        """Micro-batches per rank for a step of ``step_samples`` (default: a full step).

        The same on every rank: sized for the largest share.
        """
        n = self.global_batch_size if step_samples is None else step_samples
        largest_share = -(-n // self.world_size)
        return max(1, -(-largest_share // self.micro_batch_size))

    def micro_slices(self, share: int, step_samples: int | None = None) -> list[slice]:
        """Cut a rank's ``share`` of the step into ``accumulation_steps`` slices (some may be empty)."""
        k = self.accumulation_steps(step_samples)
        return [
            slice(
                min(i * self.micro_batch_size, share), min((i + 1) * self.micro_batch_size, share)
            )
            for i in range(k)
        ]

    def loss_scale(self, step_samples: int | None = None) -> float:
        """Multiply a micro-batch's summed per-sample loss by this before ``backward()``."""
        n = self.global_batch_size if step_samples is None else step_samples
        if n < 1:
            raise ConfigError("a step must hold at least one sample")
        return (self.world_size if self.grad_averaged else 1) / n
