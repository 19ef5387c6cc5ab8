"""ElasticSampler as the ``batch_sampler`` of torchdata's ``StatefulDataLoader`` over an HF
``datasets`` map-style ``Dataset`` (the real libraries): restarted at 2 -> 1 -> 2 ranks
within and across epochs, with the sampler's state as the checkpoint, every sample of every
completed epoch is trained once, with and without loader worker processes.

The ranks of one world are driven in this process (the sampler's share depends only on
rank, world size and its state; no collective is involved in choosing samples)."""

from __future__ import annotations

import collections
import importlib.util

import pytest

from flexrun.train.sampler import ElasticSampler

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        importlib.util.find_spec("torchdata") is None
        or importlib.util.find_spec("datasets") is None,
        reason="torchdata and datasets are not installed (pip install 'flexrun[integrations]'; "
        "not in the test extra)",
    ),
]

N, GLOBAL_BATCH, EPOCHS = 90, 8, 2


def _run(phases: list[tuple[int, int]], num_workers: int) -> dict[int, collections.Counter]:
    """Train ``phases`` of (world size, global steps) from the sampler state each phase
    saved; the samples each epoch trained, counted."""
    import datasets
    from torchdata.stateful_dataloader import StatefulDataLoader

    ds = datasets.Dataset.from_dict({"id": list(range(N))}).with_format("torch")
    seen: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    state = None
    for world, steps in phases:
        samplers = [
            ElasticSampler(N, global_batch_size=GLOBAL_BATCH, rank=r, world_size=world, seed=7)
            for r in range(world)
        ]
        for s in samplers:
            if state is not None:
                s.load_state_dict(state)

        def loaders(samplers: list[ElasticSampler] = samplers) -> list:
            return [
                iter(StatefulDataLoader(ds, batch_sampler=s, num_workers=num_workers))
                for s in samplers
            ]

        iters = loaders()
        for _ in range(steps):
            if samplers[0].exhausted:
                if samplers[0].epoch + 1 >= EPOCHS:
                    break
                for s in samplers:
                    s.set_epoch(s.epoch + 1)
                iters = loaders()
            epoch = samplers[0].epoch
            for it in iters:
                seen[epoch].update(next(it)["id"].tolist())
            for s in samplers:
                s.advance()  # (after the optimizer step, on every rank)
        state = samplers[0].state_dict()  # (what the checkpoint holds; the same on every rank)
        assert all(s.state_dict() == state for s in samplers)
    return seen


@pytest.mark.parametrize("num_workers", [0, 2])
def test_every_sample_of_every_epoch_once_across_2_1_2(num_workers: int) -> None:
    # 12 steps an epoch (11 of 8, one of 2): restarts inside epoch 0, across the boundary,
    # and inside epoch 1.
    seen = _run([(2, 5), (1, 4), (2, 6), (1, 3), (2, 100)], num_workers)
    assert sorted(seen) == list(range(EPOCHS))
    for epoch, counts in seen.items():
        assert sorted(counts) == list(range(N)), f"epoch {epoch}: missing samples"
        assert set(counts.values()) == {1}, f"epoch {epoch}: samples trained twice"
