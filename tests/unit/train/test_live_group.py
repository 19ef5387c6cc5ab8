"""EpochGroup (agreement, supersession, group formation) and broadcast_state, with a real
in-process store and one thread per member: the pieces of a live recovery below the loop."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from members_support import run_members

from flexrun.live_protocol import EpochRecord, LiveKeys
from flexrun.store.tcp import TcpStoreServer
from flexrun.train.live_group import EpochGroup, LiveAborted, LiveEnv, TrainingFinished
from flexrun.train.live_plan import MemberReport
from flexrun.train.live_sync import broadcast_state, state_checksum

pytestmark = pytest.mark.timeout(60)


def _env(port: int, worker: str, tmp: Path) -> LiveEnv:
    return LiveEnv(
        store_host="127.0.0.1",
        store_port=port,
        run_id="unit",
        worker_id=worker,
        heartbeat_file=tmp / f"{worker}.hb",
        heartbeat_interval_s=0.5,
        run_dir=None,
        round=0,
    )


def _publish(group: EpochGroup, rec: EpochRecord) -> None:
    group.store.put(LiveKeys("unit").epoch, rec.encode())


def test_members_agree_on_every_report_in_rank_order(
    server: TcpStoreServer, tmp_path: Path
) -> None:
    a = EpochGroup(_env(server.port, "a", tmp_path), timeout_s=10)
    b = EpochGroup(_env(server.port, "b", tmp_path), timeout_s=10)
    rec = EpochRecord(1, ("b", "a"), False)
    _publish(a, rec)
    got = run_members(
        [
            lambda: a.agree(rec, MemberReport(5, True, "x"), has_state=True),
            lambda: b.agree(rec, MemberReport(0, False), has_state=False),
        ]
    )
    expected = [MemberReport(0, False, None), MemberReport(5, True, "x")]
    assert got == [expected, expected]
    ranks = run_members([lambda: a.form(rec), lambda: b.form(rec)])
    assert ranks == [(1, 2), (0, 2)]
    assert a.epoch == rec and a.pg is not None and not a.pending_change
    a.leak_all()
    b.leak_all()


def test_a_newer_epoch_ends_an_agreement_that_cannot_complete(
    server: TcpStoreServer, tmp_path: Path
) -> None:
    a = EpochGroup(_env(server.port, "a", tmp_path), timeout_s=10)
    rec = EpochRecord(1, ("a", "gone"), True)
    _publish(a, rec)
    timer = threading.Timer(0.3, _publish, (a, EpochRecord(2, ("a",), True)))
    timer.start()
    try:
        with pytest.raises(LiveAborted, match="epoch 2 superseded 1"):
            a.agree(rec, MemberReport(3, True, "x"), has_state=True)
    finally:
        timer.cancel()


@pytest.mark.parametrize("which", ["group", "subgroup"])
def test_a_member_lost_before_the_group_forms_costs_the_others_nothing_past_the_next_epoch(
    server: TcpStoreServer, tmp_path: Path, which: str
) -> None:
    """Both agreed; "b" is lost before it forms the epoch's group (or, sharded, the
    subgroup of its shard's replicas): gloo would wait for it the whole timeout (30 s
    here). The next epoch, published 0.3 s later, ends a's wait; a's store connection,
    which the abandoned forming thread still holds, is replaced, so the next epoch's
    agreement and group form at once."""
    a = EpochGroup(_env(server.port, "a", tmp_path), timeout_s=30)
    b = EpochGroup(_env(server.port, "b", tmp_path), timeout_s=30)
    rec = EpochRecord(1, ("a", "b"), True)
    _publish(a, rec)
    report = MemberReport(3, True, "x")
    run_members([lambda: a.agree(rec, report, has_state=True),
              lambda: b.agree(rec, report, has_state=True)])  # fmt: skip
    if which == "subgroup":
        run_members([lambda: a.form(rec), lambda: b.form(rec)])
    timer = threading.Timer(0.3, _publish, (a, EpochRecord(2, ("a", "b"), True)))
    timer.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(LiveAborted, match="superseded while it formed"):
            a.form(rec) if which == "group" else a.subgroup(rec, "r1", 0, 2)
    finally:
        timer.cancel()
    assert time.monotonic() - t0 < 10, "waited for the lost member, not for the next epoch"
    rec2 = EpochRecord(2, ("a", "b"), True)
    a.abandon()
    b.abandon()
    t0 = time.monotonic()
    run_members([lambda: a.agree(rec2, report, has_state=True),
              lambda: b.agree(rec2, report, has_state=True)])  # fmt: skip
    assert run_members([lambda: a.form(rec2), lambda: b.form(rec2)]) == [(0, 2), (1, 2)]
    assert time.monotonic() - t0 < 10, "the next epoch waited on the abandoned connection"
    a.leak_all()
    b.leak_all()


def test_a_growing_epoch_published_while_the_group_forms_does_not_stop_it(
    server: TcpStoreServer, tmp_path: Path
) -> None:
    """A joiner's epoch (growing: every member stays) appears while "a" waits for "b" to
    form the group: "a" goes on forming (it takes the change at a step boundary). Had it
    stopped alone, its forming thread would still complete the group for "b", who would
    then wait in its first collective on "a" for the whole timeout."""
    a = EpochGroup(_env(server.port, "a", tmp_path), timeout_s=30)
    b = EpochGroup(_env(server.port, "b", tmp_path), timeout_s=30)
    rec = EpochRecord(1, ("a", "b"), True)
    _publish(a, rec)

    def late_b() -> tuple[int, int]:
        time.sleep(0.3)
        _publish(b, EpochRecord(2, ("a", "b", "c"), False))
        time.sleep(0.3)
        return b.form(rec)

    assert run_members([lambda: a.form(rec), late_b]) == [(0, 2), (1, 2)]
    a.check_epoch(time.monotonic() + 1)
    assert a.pending_change
    a.leak_all()
    b.leak_all()


def test_a_group_that_cannot_form_is_an_aborted_epoch(
    server: TcpStoreServer, tmp_path: Path
) -> None:
    a = EpochGroup(_env(server.port, "a", tmp_path), timeout_s=1)
    rec = EpochRecord(1, ("a", "gone"), True)
    _publish(a, rec)
    with pytest.raises(LiveAborted, match="epoch 1's group did not form: .*timeout"):
        a.form(rec)


def test_a_stateless_worker_leaves_once_the_job_is_done(
    server: TcpStoreServer, tmp_path: Path
) -> None:
    a = EpochGroup(_env(server.port, "a", tmp_path), timeout_s=10)
    a.mark_done(7)
    with pytest.raises(TrainingFinished):
        a.next_epoch(-1, has_state=False)
    a.check_finished(has_state=True)  # a member that holds state finishes in the loop


def test_changes_of_epoch_abort_or_defer_as_the_record_says(
    server: TcpStoreServer, tmp_path: Path
) -> None:
    a = EpochGroup(_env(server.port, "a", tmp_path), timeout_s=10)
    a.epoch = EpochRecord(1, ("a", "b"), False)
    _publish(a, EpochRecord(2, ("a", "b", "c"), False))
    a.check_epoch(0.0)
    assert a.pending_change  # growing: switch at the next step boundary
    _publish(a, EpochRecord(3, ("a", "c"), True))
    with pytest.raises(LiveAborted, match="epoch 3 replaced epoch 1"):
        a.check_epoch(1.0)


def test_broadcast_hands_the_source_state_to_every_member(
    server: TcpStoreServer, tmp_path: Path
) -> None:
    groups = [EpochGroup(_env(server.port, w, tmp_path), timeout_s=10) for w in ("a", "b", "c")]
    rec = EpochRecord(1, ("a", "b", "c"), False)
    _publish(groups[0], rec)
    models, opts = [], []
    for seed in range(3):
        torch.manual_seed(seed)
        m = torch.nn.Linear(4, 2)
        o = torch.optim.Adam(m.parameters(), lr=0.1)
        m(torch.ones(1, 4)).sum().backward()
        o.step()
        models.append(m)
        opts.append(o)
    assert len({state_checksum(m) for m in models}) == 3
    report = MemberReport(0, False)
    run_members([lambda g=g: g.agree(rec, report, has_state=False) for g in groups])
    run_members([lambda g=g: g.form(rec) for g in groups])
    steps = run_members(
        [
            lambda i=i: broadcast_state(
                groups[i].pg,
                groups[i].wait,
                rank=i,
                source=1,
                model=models[i],
                optimizer=opts[i],
                step=[0, 9, 4][i],
            )
            for i in range(3)
        ]
    )
    assert steps == [9, 9, 9]
    assert len({state_checksum(m) for m in models}) == 1
    assert state_checksum(models[0]) == state_checksum(models[1])
    assert all(o.state_dict()["state"][0]["step"] == 1 for o in opts)
    for g in groups:
        g.leak_all()
