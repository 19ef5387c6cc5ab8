from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils.data import DataLoader

from flexrun.errors import CheckpointError
from flexrun.train import ElasticSampler


def _run_steps(
    sampler_state: dict | None, world: int, steps: int, n: int, g: int
) -> tuple[list[int], dict]:
    """Simulate `world` ranks taking `steps` steps; return all consumed ids and the state."""
    samplers = [
        ElasticSampler(n, global_batch_size=g, rank=r, world_size=world, seed=5)
        for r in range(world)
    ]
    if sampler_state is not None:
        for s in samplers:
            s.load_state_dict(sampler_state)
    iters = [iter(s) for s in samplers]
    seen: list[int] = []
    for _ in range(steps):
        if samplers[0].exhausted:
            for s in samplers:
                s.set_epoch(s.epoch + 1)
            iters = [iter(s) for s in samplers]
        n_step = samplers[0].step_samples()
        shares = [next(it) for it in iters]
        assert sum(len(x) for x in shares) == n_step
        assert max(len(x) for x in shares) - min(len(x) for x in shares) <= 1
        seen.extend(i for share in shares for i in share)
        for s in samplers:
            s.advance(n_step)
    return seen, samplers[0].state_dict()


def test_order_is_deterministic_per_seed_and_epoch() -> None:
    a = ElasticSampler(100, global_batch_size=8, seed=1)
    b = ElasticSampler(100, global_batch_size=8, seed=1, world_size=3, rank=2)
    assert a.order(0) == b.order(0)
    assert a.order(0) != a.order(1)
    assert sorted(a.order(3)) == list(range(100))


def test_every_sample_is_consumed_exactly_once_across_world_size_changes() -> None:
    n, g = 103, 10  # uneven: a partial last step, shares of 4/3/3
    seen1, st = _run_steps(None, world=2, steps=4, n=n, g=g)
    seen2, st = _run_steps(st, world=1, steps=3, n=n, g=g)
    seen3, st = _run_steps(st, world=3, steps=4, n=n, g=g)  # finishes epoch 0 (11 steps)
    assert st["epoch"] == 0 and st["consumed"] == n
    counts = Counter(seen1 + seen2 + seen3)
    assert set(counts) == set(range(n)) and set(counts.values()) == {1}


def test_global_batches_do_not_depend_on_world_size() -> None:
    n, g = 50, 8
    one = ElasticSampler(n, global_batch_size=g, seed=2)
    two = [ElasticSampler(n, global_batch_size=g, seed=2, rank=r, world_size=2) for r in range(2)]
    for step1, *shares in zip(one, *two, strict=True):
        assert sorted(step1) == sorted(shares[0] + shares[1])


def test_state_dict_rejects_another_dataset() -> None:
    s = ElasticSampler(10, global_batch_size=2)
    with pytest.raises(CheckpointError):
        s.load_state_dict(ElasticSampler(11, global_batch_size=2).state_dict())


def test_set_epoch_keeps_progress_of_the_same_epoch() -> None:
    s = ElasticSampler(10, global_batch_size=2)
    s.advance()
    s.set_epoch(0)
    assert s.consumed == 2
    s.set_epoch(1)
    assert s.consumed == 0


def test_drop_last_skips_the_partial_step() -> None:
    s = ElasticSampler(10, global_batch_size=4, drop_last=True)
    assert [len(x) for x in s] == [4, 4]


@pytest.mark.timeout(60)
def test_works_as_batch_sampler_of_a_dataloader_with_workers() -> None:
    s = ElasticSampler(40, global_batch_size=8, rank=1, world_size=2, seed=3)
    s.advance(16)
    loader = DataLoader(range(40), batch_sampler=s, collate_fn=torch.tensor, num_workers=2)
    got = [b.tolist() for b in loader]
    assert got == list(s) and len(got) == 3 and all(len(b) == 4 for b in got)
