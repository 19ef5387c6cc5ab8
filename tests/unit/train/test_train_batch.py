from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flexrun.errors import ConfigError
from flexrun.train import BatchPlan


def test_accumulation_steps_are_equal_on_every_rank() -> None:
    plan = BatchPlan(global_batch_size=64, micro_batch_size=8, world_size=3)
    assert plan.accumulation_steps() == 3  # largest share 22 -> 3 micro-batches
    assert [s.stop - s.start for s in plan.micro_slices(21)] == [8, 8, 5]
    assert [s.stop - s.start for s in plan.micro_slices(1, step_samples=5)] == [1]


@pytest.mark.parametrize(("world", "micro", "n"), [(1, 4, 16), (2, 3, 16), (3, 4, 17), (4, 2, 5)])
def test_averaged_gradient_equals_single_process_gradient(world: int, micro: int, n: int) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3).double()
    x, y = torch.randn(n, 5, dtype=torch.float64), torch.randint(0, 3, (n,))
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()  # mean over the global batch, one process
    ref = model.weight.grad.clone()

    plan = BatchPlan(global_batch_size=n, micro_batch_size=micro, world_size=world)
    per_rank = []
    idx = torch.arange(n)
    for r in range(world):
        share = idx[r::world]
        model.zero_grad()
        for sl in plan.micro_slices(len(share), n):
            part = share[sl]
            loss = F.cross_entropy(model(x[part]), y[part], reduction="sum")
            (loss * plan.loss_scale(n)).backward()
        per_rank.append(model.weight.grad.clone())
    averaged = sum(per_rank) / world  # what DDP's all-reduce produces
    torch.testing.assert_close(averaged, ref, rtol=1e-12, atol=1e-12)


def test_invalid_sizes_are_rejected() -> None:
    with pytest.raises(ConfigError):
        BatchPlan(global_batch_size=0, micro_batch_size=1, world_size=1)
