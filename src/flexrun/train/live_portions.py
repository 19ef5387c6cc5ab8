"""Portions of a sharded live step: which replica group computes which part of the batch.

Owns how a sharded live job (``--live-shards S``) cuts a step's global batch while the
number of replica groups changes. The batch is cut into ``P`` portions, ``P`` the most
groups any epoch of the job has had (carried in the members' reports). Portion ``k`` is
the samples of the virtual ranks ``k*S .. k*S+S-1`` (shard ``i`` of it: ``split_share(
global_batch, P*S, k*S+i)``), so a portion's samples, micro-batches and random seed do
not depend on which group computes it. Each epoch shares the ``P`` portions between its
groups: with ``P`` groups each computes its own and nothing differs from a plain split.

With fewer groups (a group lost, its replacement not yet in the loop) a group computes
several; each portion's gradient is accumulated apart and the portions are summed once,
so at two portions the step is bitwise the one two groups would have computed (a sum of
two terms does not depend on its order; of more it may, within rounding).

A group that had computed its portions of a step when the epoch changed under the step's
gradient sum *holds* them: in the next epoch it computes only what the groups that left
had, instead of the whole step again. A hold counts only when every member of the group
reports the same one, at the newest committed step, and the epoch does not fall back to
a checkpoint.

It does not run the loop (``flexrun.train.live``) or sum across groups (``live_shards``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence

import torch

from flexrun.errors import ConfigError
from flexrun.live_protocol import MemberReport


def split_share(global_batch: int, world: int, rank: int) -> tuple[int, int]:
    """[start, end) of ``rank``'s contiguous share of a global batch (sizes differ by <= 1)."""
    base, extra = divmod(global_batch, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def micro_chunks(indices: list[int], size: int | None, largest: int) -> list[list[int]]:
    """``indices`` in as many micro-batches as the rank with the ``largest`` share makes:
    a group's shards run FSDP collectives per forward and backward, so every rank must
    make as many (shares differ by at most one sample).

    Raises:
        ConfigError: this rank's share is too small for that many micro-batches.
    """
    count = max(1, math.ceil(largest / (size or max(1, largest))))
    if len(indices) < count:
        raise ConfigError(
            f"global batch too small: a share of {len(indices)} sample(s) cannot make the "
            f"{count} micro-batch(es) the other shards make"
        )
    base, extra = divmod(len(indices), count)
    out, start = [], 0
    for k in range(count):
        end = start + base + (1 if k < extra else 0)
        out.append(indices[start:end])
        start = end
    return out


def assign(
    reports: Sequence[MemberReport], groups: Sequence[Sequence[int]], *, keep: bool
) -> tuple[int, list[tuple[int, ...]], list[tuple[int, ...]]]:
    """The epoch's portion count, each group's portions (held first, in the order it
    computes them) and each group's accepted hold, from the members' ``reports`` (by
    epoch rank) and the epoch's ``groups`` (epoch ranks, in layout order). ``keep``:
    holds may count (False when the epoch falls back to a checkpoint)."""
    count = max([len(groups), *(r.portions for r in reports)])
    newest = max((r.step for r in reports if r.has_state), default=-1)
    taken: set[int] = set()
    held: list[tuple[int, ...]] = []
    for ranks in groups:
        claims = {reports[r].held for r in ranks}
        h = claims.pop() if len(claims) == 1 else ()
        ok = (
            keep
            and all(reports[r].has_state and reports[r].step == newest for r in ranks)
            and len(set(h)) == len(h)
            and all(0 <= k < count and k not in taken for k in h)
        )
        held.append(h if ok else ())
        taken.update(held[-1])
    mine = [list(h) for h in held]
    for k in range(count):
        if k not in taken:
            g = min(range(len(groups)), key=lambda i: (len(mine[i]), i))
            mine[g].append(k)
    return count, [tuple(m) for m in mine], held


class Portions:
    """One sharded worker's portions of the step in hand, and their gradients."""

    def __init__(self, shards: int, shard: int) -> None:
        self.shards = shards
        self.shard = shard
        self.count = 0
        """Portions per step (0 before the worker's first epoch)."""
        self.mine: tuple[int, ...] = ()
        """This epoch's portions of this worker's group."""
        self.held: tuple[int, ...] = ()
        """Portions of step ``committed`` whose gradients this worker holds."""
        self._aside: list[torch.Tensor | None] | None = None

    def adopt(
        self, reports: Sequence[MemberReport], groups: Sequence[Sequence[int]], rank: int, *,
        keep: bool,
    ) -> None:  # fmt: skip
        """Take this epoch's share of the portions (``rank``: this worker's epoch rank)."""
        self.count, mine, held = assign(reports, groups, keep=keep)
        g = next(i for i, ranks in enumerate(groups) if rank in ranks)
        self.mine = mine[g]
        if held[g] != self.held:
            self.drop()

    def begin(self, params: Sequence[torch.nn.Parameter]) -> None:
        """A step's start: a worker holding nothing starts from no gradient."""
        if not self.held:
            self.drop()
            for p in params:
                p.grad = None

    def shares(self, number: int, global_batch: int) -> list[tuple[int, range, bool]]:
        """(virtual rank, global sample positions, held) of each of this group's portions
        of step ``number``, in the order computed (the held ones first)."""
        world = self.count * self.shards
        out = []
        for k in self.mine:
            v = k * self.shards + self.shard
            start, end = split_share(global_batch, world, v)
            base = number * global_batch
            out.append((v, range(base + start, base + end), k in self.held))
        return out

    def chunks(
        self,
        shares: Sequence[tuple[int, list[int]]],
        micro_batch: int | None,
        global_batch: int,
        params: Sequence[torch.nn.Parameter],
        reseed: Callable[[int], object],
    ) -> Iterator[list[int]]:
        """Micro-batches of ``shares`` ((virtual rank, dataset indices) per portion): before
        each portion the gradients so far are set aside and the seed is the virtual rank's."""
        largest = -(-global_batch // (self.count * self.shards))
        for v, indices in shares:
            self._set_aside(params)
            reseed(v)
            yield from micro_chunks(indices, micro_batch, largest)

    def _set_aside(self, params: Sequence[torch.nn.Parameter]) -> None:
        from flexrun.train.live_shards import local

        grads = [p.grad for p in params]
        if all(g is None for g in grads):
            return
        if self._aside is None:
            self._aside = [local(g).clone() if g is not None else None for g in grads]
        else:
            for i, g in enumerate(grads):
                if g is not None:
                    a = self._aside[i]
                    self._aside[i] = local(g).clone() if a is None else a.add_(local(g))
        for p in params:
            p.grad = None

    def summed(self, i: int, grad: torch.Tensor) -> torch.Tensor:
        """Parameter ``i``'s gradient over every portion: ``grad`` (the last portion's,
        flat) plus what was set aside."""
        a = self._aside[i] if self._aside is not None else None
        return grad if a is None else grad + a.reshape(-1)

    def hold(self) -> None:
        """The step's gradient sum was abandoned: this worker holds its portions of it."""
        self.held = self.mine

    def drop(self) -> None:
        """No gradient is held (the step committed, or what was held no longer counts)."""
        self.held, self._aside = (), None


__all__ = ["Portions", "assign", "micro_chunks", "split_share"]
