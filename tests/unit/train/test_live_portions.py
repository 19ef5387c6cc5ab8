"""Portions of a sharded live step: which group computes which part of the batch, what a
group that held its gradients across an epoch change keeps, and the gradient sum of a
group that computed several portions."""

from __future__ import annotations

import pytest
import torch

from flexrun.live_protocol import MemberReport
from flexrun.train.live_portions import Portions, assign, split_share


def _m(step: int = 7, *, state: bool = True, portions: int = 0, held: tuple[int, ...] = ()) -> MemberReport:  # fmt: skip
    return MemberReport(step, state, "c" if state else None, "g", 0, portions=portions, held=held)


def test_with_as_many_groups_as_portions_each_group_computes_its_own() -> None:
    count, mine, held = assign([_m()] * 6, [(0, 1), (2, 3), (4, 5)], keep=True)
    assert (count, mine, held) == (3, [(0,), (1,), (2,)], [(), (), ()])


def test_a_lost_groups_portion_goes_to_the_survivor_after_the_one_it_holds() -> None:
    # Two groups, P = 2; group 0 was lost while group 1 held portion 1 of step 7.
    reports = [_m(portions=2, held=(1,)), _m(portions=2, held=(1,))]
    count, mine, held = assign(reports, [(0, 1)], keep=True)
    assert (count, mine, held) == (2, [(1, 0)], [(1,)])


def test_the_replacement_gets_what_no_survivor_holds() -> None:
    reports = [_m(portions=2, held=(0,))] * 2 + [_m(0, state=False)] * 2
    assert assign(reports, [(0, 1), (2, 3)], keep=True)[1:] == ([(0,), (1,)], [(0,), ()])


@pytest.mark.parametrize(
    ("reports", "keep"),
    [
        ([_m(portions=2, held=(1,)), _m(portions=2)], True),  # the mates disagree
        ([_m(portions=2, held=(1,))] * 2 + [_m(8, portions=2)] * 2, True),  # a newer step
        ([_m(portions=2, held=(1,))] * 2, False),  # the epoch loads a checkpoint
    ],
)
def test_a_hold_that_cannot_be_trusted_is_dropped(reports: list[MemberReport], keep: bool) -> None:
    groups = [(0, 1)] if len(reports) == 2 else [(0, 1), (2, 3)]
    count, mine, held = assign(reports, groups, keep=keep)
    assert held[0] == () and sorted(sum(mine, ())) == list(range(count))


def test_two_groups_claiming_one_portion_keep_it_once() -> None:
    reports = [_m(portions=3, held=(1,))] * 4
    count, mine, held = assign(reports, [(0, 1), (2, 3)], keep=True)
    assert held == [(1,), ()] and sorted(sum(mine, ())) == [0, 1, 2]


def test_reports_carry_the_portions_and_refuse_junk() -> None:
    m = _m(portions=4, held=(3, 0))
    assert MemberReport.decode(m.encode()) == m
    for junk in ('"portions": -1', '"portions": 2, "held": [2]', '"portions": true',
                 '"portions": 1, "held": [0, 0]', '"held": "0"'):  # fmt: skip
        with pytest.raises(ValueError, match="malformed member report"):
            MemberReport.decode('{"step": 1, "has_state": true, ' + junk + "}")


def test_the_shares_say_which_portions_are_held_and_cover_the_groups_portions() -> None:
    p = Portions(shards=2, shard=1)
    p.count, p.mine, p.held = 2, (1, 0), (1,)
    # virtual ranks 3 and 1 of 4: samples 8..9 (held) and 3..5 of step 3
    assert p.shares(3, 10) == [(3, range(38, 40), True), (1, range(33, 36), False)]
    p.held = ()
    assert p.shares(3, 10) == [(3, range(38, 40), False), (1, range(33, 36), False)]
    assert split_share(10, 4, 3) == (8, 10) and split_share(10, 4, 1) == (3, 6)


def _grads_of(portions: Portions, params: list[torch.nn.Parameter], data: list[float]) -> torch.Tensor:  # fmt: skip
    """Run the chunks of one portion per value in ``data``, each adding it as a gradient."""
    seeds: list[int] = []
    shares = [(v, [v]) for v in range(len(data))]
    for chunk in portions.chunks(shares, None, len(data) * 2, params, seeds.append):
        assert params[0].grad is None  # (each portion's gradient starts from none)
        (params[0] * data[chunk[0]]).sum().backward()
    assert seeds == list(range(len(data)))
    g = params[0].grad
    assert g is not None
    return portions.summed(0, g.reshape(-1))


def test_each_portion_accumulates_apart_and_two_sum_as_two_groups_would() -> None:
    w = torch.nn.Parameter(torch.ones(3))
    p = Portions(shards=2, shard=0)
    p.count, p.mine = 2, (0, 1)
    a, b = 0.1, 1e8
    total = _grads_of(p, [w], [a, b])
    # two groups: each its own portion, then one all-reduce of two terms
    assert torch.equal(total, torch.full((3,), b) + torch.full((3,), a))
    p.hold()
    assert p.held == (0, 1)
    p.begin([w])  # (holding: the gradients stay for the next epoch)
    assert w.grad is not None
    p.drop()
    p.begin([w])
    assert w.grad is None and p.summed(0, torch.zeros(3)).tolist() == [0.0, 0.0, 0.0]


def test_adopting_an_epoch_that_does_not_keep_the_hold_drops_it() -> None:
    p = Portions(shards=2, shard=0)
    p.count, p.mine, p.held = 2, (1,), (1,)
    p.adopt([_m(portions=2, held=(1,))] * 2, [(0, 1)], 1, keep=False)
    assert (p.held, p.mine) == ((), (0, 1))
    p.held = (1,)
    p.adopt([_m(portions=2, held=(1,))] * 2, [(0, 1)], 0, keep=True)
    assert (p.held, p.mine) == ((1,), (1, 0))
