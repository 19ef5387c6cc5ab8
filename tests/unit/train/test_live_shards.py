"""Sharded live mode's pure parts: the epoch's replica groups, the plan over groups, the
micro-batches every shard makes, and the worker's environment."""

from __future__ import annotations

import pytest

from flexrun.errors import ConfigError, LiveAborted
from flexrun.live_protocol import LiveEnv, MemberReport, worker_env
from flexrun.train.live_shards import Layout, micro_chunks, plan_groups, shard_mesh


def _m(group: str, shard: int, step: int = 7, state: bool = True, sums: str = "c") -> MemberReport:
    return MemberReport(step, state, f"{sums}{shard}" if state else None, group, shard)


def test_groups_are_ordered_by_their_first_member_and_shards_by_index() -> None:
    reports = [_m("b", 1), _m("a", 0), _m("b", 0), _m("a", 1)]
    layout = Layout.of(reports, 2)
    assert layout.groups == ((2, 0), (1, 3))
    assert layout.replicas(0) == [2, 1] and layout.replicas(1) == [0, 3]


@pytest.mark.parametrize(
    "reports",
    [
        [_m("a", 0), _m("a", 1), _m("b", 0)],  # a group short of a shard
        [_m("a", 0), _m("a", 0)],  # a shard twice
        [_m("a", 0), MemberReport(7, True, "x")],  # a whole-model member
        [_m("a", 0), _m("a", 2)],  # a shard index out of range
    ],
)
def test_an_epoch_that_is_not_whole_groups_is_not_formed(reports: list[MemberReport]) -> None:
    with pytest.raises(LiveAborted):
        Layout.of(reports, 2)


def test_a_new_group_takes_each_shard_from_the_healthy_groups_same_shard() -> None:
    reports = [_m("a", 0), _m("a", 1), _m("n", 0, 0, False), _m("n", 1, 0, False)]
    layout = Layout.of(reports, 2)
    for shard in (0, 1):
        plan = plan_groups(reports, layout, shard, formed=True)
        assert (plan.source, plan.transfer, plan.load_durable) == (0, True, False)
        assert plan.fallback is None


def test_healthy_groups_at_one_step_need_no_transfer() -> None:
    reports = [_m("a", 0), _m("a", 1), _m("b", 0), _m("b", 1)]
    plan = plan_groups(reports, Layout.of(reports, 2), 1, formed=True)
    assert not plan.transfer and plan.fallback is None


def test_a_group_one_step_ahead_is_the_source_of_every_shard() -> None:
    reports = [_m("a", 0, 6), _m("a", 1, 6), _m("b", 0, 7), _m("b", 1, 7)]
    layout = Layout.of(reports, 2)
    assert [plan_groups(reports, layout, s, formed=True).source for s in (0, 1)] == [1, 1]


def test_a_commit_torn_between_shards_falls_back_on_every_shard() -> None:
    # Shard 0 reached step 8 somewhere, shard 1 nowhere: no group holds one consistent model.
    reports = [_m("a", 0, 8), _m("a", 1, 7), _m("n", 0, 0, False), _m("n", 1, 0, False)]
    layout = Layout.of(reports, 2)
    for shard in (0, 1):
        plan = plan_groups(reports, layout, shard, formed=True)
        assert plan.load_durable and plan.fallback is not None and "[7, 8]" in plan.fallback


def test_replicas_that_disagree_on_a_shard_fall_back_on_every_shard() -> None:
    reports = [_m("a", 0), _m("a", 1), _m("b", 0), _m("b", 1, sums="z")]
    layout = Layout.of(reports, 2)
    plan = plan_groups(reports, layout, 0, formed=True)
    assert plan.load_durable and plan.fallback is not None and "checksum" in plan.fallback


def test_the_first_epoch_of_a_job_loads_on_the_first_group_and_broadcasts() -> None:
    reports = [_m(g, s, 0, False) for g in "ab" for s in (0, 1)]
    plan = plan_groups(reports, Layout.of(reports, 2), 0, formed=False)
    assert (plan.source, plan.transfer, plan.load_durable, plan.fallback) == (0, True, True, None)


def test_a_member_report_keeps_its_group_and_shard_and_old_reports_still_read() -> None:
    m = _m("node.g1.4", 1)
    assert MemberReport.decode(m.encode()) == m
    assert MemberReport.decode('{"step": 3, "has_state": false}') == MemberReport(3, False)


@pytest.mark.parametrize(
    ("share", "size", "largest", "lengths"),
    [
        (list(range(8)), None, 8, [8]),
        (list(range(7)), None, 8, [7]),  # one sample short of the largest share: one batch too
        (list(range(5)), 2, 6, [2, 2, 1]),  # 3 batches, as the rank with 6 makes
        (list(range(6)), 4, 6, [3, 3]),
    ],
)
def test_every_rank_makes_as_many_micro_batches_as_the_largest_share(
    share: list[int], size: int | None, largest: int, lengths: list[int]
) -> None:
    chunks = micro_chunks(share, size, largest)
    assert [len(c) for c in chunks] == lengths and sum(chunks, []) == share


def test_a_share_too_small_for_the_micro_batch_count_is_one_clear_error() -> None:
    with pytest.raises(ConfigError, match="global batch too small"):
        micro_chunks([1], 1, 2)


def _env(**extra: str) -> dict[str, str]:
    env = worker_env(
        store=("127.0.0.1", 1), worker_id="n.w1", heartbeat=__import__("pathlib").Path("/x"),
        heartbeat_interval_s=0.5,
    )  # fmt: skip
    env["FLEXRUN_RUN_ID"] = "r"
    env.update(extra)
    return env


def test_the_environment_says_the_group_and_a_malformed_one_is_one_clear_error() -> None:
    env = LiveEnv.from_environ(
        {**_env(), **worker_env(store=("h", 2), worker_id="n.w2", heartbeat=__import__(
            "pathlib").Path("/y"), heartbeat_interval_s=0.5, group=(2, "n.g0.1", 1))}
    )  # fmt: skip
    assert (env.shards, env.group, env.shard) == (2, "n.g0.1", 1)
    for bad in ({"FLEXRUN_LIVE_SHARDS": "2"}, {"FLEXRUN_LIVE_SHARDS": "2", "FLEXRUN_LIVE_GROUP":
                "g", "FLEXRUN_LIVE_SHARD": "2"}, {"FLEXRUN_LIVE_SHARDS": "0"}):  # fmt: skip
        with pytest.raises(ConfigError, match="malformed"):
            LiveEnv.from_environ(_env(**bad))


def test_shard_mesh_outside_a_sharded_live_job_is_one_clear_error() -> None:
    with pytest.raises(ConfigError, match="--live-shards"):
        shard_mesh(environ=_env())
    with pytest.raises(ConfigError, match="flexrun run --mode live"):
        shard_mesh(environ={})
